"""The served decode step, traced where users meet it: `appliance serve MODEL_DIR --load-format
dummy` (extra flags after `--`), `--concurrency` streams of `--output-len` tokens, and mid-decode
POST /start_profile {num_steps} (engine/profiler.py); then ops/gpu/trace_steps.py on rank 0's
trace: per step, the period (= the time per token at concurrency 1, MTP off), the host's range and
the device's busy time, so host-bound steps show as device idle.

    python3 ops/gpu/served_trace.py --model-dir .cache/serve27b --out $OUT/trace \
        -- --quantization fp8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trace_steps  # noqa: E402

from appliance.engine.profiler import trace_path  # noqa: E402


def post(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url: str, proc: subprocess.Popen, limit_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode})")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return time.monotonic() - t0
        except OSError:
            time.sleep(1)
    raise SystemExit("server not ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=600)
    ap.add_argument("--num-steps", type=int, default=40)
    ap.add_argument("--delay", type=float, default=1.0, help="seconds into decode before tracing")
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    log = open(os.path.join(args.out, "serve.log"), "w")
    cmd = [sys.executable, "-m", "appliance.cli", "serve", args.model_dir, "--load-format"]
    cmd += ["dummy", "--no-vision", "--port", str(args.port), *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        print(f"ready in {wait_ready(url, proc, 400):.0f} s", flush=True)
        body = {
            "prompt": list(range(1000, 1000 + args.input_len)),
            "max_tokens": args.output_len,
            "ignore_eos": True,
            "temperature": 0,
        }
        post(f"{url}/v1/completions", dict(body, max_tokens=8))  # warm-up
        clients = [
            threading.Thread(target=post, args=(f"{url}/v1/completions", body))
            for _ in range(args.concurrency)
        ]
        start = time.monotonic()
        for c in clients:
            c.start()
        time.sleep(args.delay)
        started = post(
            f"{url}/start_profile",
            {"output_dir": os.path.abspath(args.out), "num_steps": args.num_steps},
        )
        for c in clients:
            c.join()
        wall = time.monotonic() - start
        print(f"{args.concurrency} x {args.output_len} tokens in {wall:.2f} s", flush=True)
        path = trace_path(started["output_dir"], started["profile_id"], 0)
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.5)
        if not os.path.exists(path):  # the requests ended before num_steps: stop it here
            print("fewer steps than --num-steps ran while tracing", flush=True)
            post(f"{url}/stop_profile")
        times = trace_steps.step_times(trace_steps.load_events(path))
        result = trace_steps.summary(times)
        print(json.dumps(result), flush=True)
        with open(os.path.join(args.out, "steps.json"), "w") as f:
            json.dump({"summary": result, "serve_args": args.serve_args, "wall_s": wall}, f)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


if __name__ == "__main__":
    main()
