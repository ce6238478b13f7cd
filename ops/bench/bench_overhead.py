"""The appliance's own per-step overhead — scheduling, IPC (msgpack + ZMQ) and detokenization — with
the model forward made trivial, at batch 1, 16 and 64. Target: under 1 ms per step at batch 64.
  python ops/bench/bench_overhead.py                  # in-process breakdown (stable, no OS noise)
  python ops/bench/bench_overhead.py --mode live      # real processes, TrivialRunner, via HTTP
  python ops/bench/bench_overhead.py --json out.json

inproc: one process does exactly the per-step work of the router, the worker seam and the
detokenizer (schedule, StepPlan/StepResult/RouterOutput/DetokOutput encode+decode, update,
detokenize), timed per component in CPU time (time.process_time), so other load on a shared machine
does not inflate it. live: `appliance serve --runner ops.bench.bench_overhead:TrivialRunner` with B
concurrent streams; reports the router's own step time minus the (trivial) forward, read from
/debug/status, and the tokens/s the clients received.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from appliance.config import SchedulerConfig  # noqa: E402
from appliance.detokenizer.detokenizer import Detokenizer  # noqa: E402
from appliance.detokenizer.tokenizer import TextTokenizer  # noqa: E402
from appliance.messages import (  # noqa: E402
    DetokOutput,
    DetokParams,
    DetokRegister,
    RouterOutput,
    SampledTokens,
    SamplingOptions,
    StepPlan,
    StepResult,
    TokenUpdate,
    decoder,
    encode,
)
from appliance.router.request import Request  # noqa: E402
from appliance.router.scheduler import Scheduler  # noqa: E402

SAMPLE_TEXT = (
    "The appliance streams tokens to every client as soon as they are sampled; "
    "héllo wörld, 你好, numbers 12345 and code: def f(x): return x * 2\n"
)


class TrivialRunner:
    """A ModelRunner stand-in whose forward costs nothing: each sampling chunk gets the next token
    of a fixed text (so detokenization does real work). Never emits eos: max_tokens ends requests.
    """

    def __init__(self, config, rank: int = 0, world_size: int = 1) -> None:
        from appliance.assets.resolve import resolve_model_dir

        self.model_dir = resolve_model_dir(config.model.model_dir)
        self.num_kv_slots = config.scheduler.num_kv_slots or 1 << 20
        self.max_model_len = config.model.max_model_len or 8192
        self.eos_token_ids: list[int] = []
        self._cycle = TextTokenizer.from_pretrained(self.model_dir).encode(SAMPLE_TEXT)
        self._count: dict[int, int] = defaultdict(int)
        self._done: list[StepResult] = []  # the worker loop's submit / collect protocol

    @property
    def num_pending(self) -> int:
        return len(self._done)

    def submit(self, plan: StepPlan) -> None:
        self._done.append(self.execute(plan))

    def collect(self) -> StepResult:
        return self._done.pop(0)

    def oldest_done(self) -> bool:
        return bool(self._done)

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        for slot in plan.released_slots:
            self._count.pop(slot, None)
        sampled = []
        for chunk in plan.chunks:
            if chunk.sample:
                n = self._count[chunk.req_slot]
                self._count[chunk.req_slot] = n + 1
                sampled.append(SampledTokens(chunk.req_slot, [self._cycle[n % len(self._cycle)]]))
        return StepResult(plan.step_id, sampled, time.perf_counter() - start)


# ---------------------------------------------------------------------- in-process breakdown


def bench_inproc(model_dir: str, batch: int, steps: int) -> dict[str, float]:
    from appliance.config import EngineConfig, ModelConfig

    config = EngineConfig(model=ModelConfig(model_dir=model_dir))
    runner = TrivialRunner(config)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192),
        num_kv_slots=1 << 20,
        max_model_len=1 << 16,
    )
    detok = Detokenizer(TextTokenizer.from_pretrained(runner.model_dir))
    plan_dec, result_dec = decoder(StepPlan), decoder(StepResult)
    out_dec, delta_dec = decoder(RouterOutput), decoder(DetokOutput)
    registers = []
    for i in range(batch):
        req_id = f"bench-{i}"
        sched.add_request(
            Request(req_id, list(range(10, 18)), SamplingOptions(seed=i), max_tokens=steps + 100)
        )
        registers.append(DetokRegister(req_id, 8, DetokParams(stop=["\n\n"])))
    detok.process(out_dec.decode(encode(RouterOutput(registers=registers))))
    times: dict[str, float] = defaultdict(float)
    clock = time.process_time
    for step in range(steps + 20):
        t0 = clock()
        plan = sched.schedule()
        t1 = clock()
        plan = plan_dec.decode(encode(plan))  # router -> worker
        t2 = clock()
        result = runner.execute(plan)
        t3 = clock()
        result = result_dec.decode(encode(result))  # worker -> router
        t4 = clock()
        updates = [TokenUpdate(o.req_id, o.new_token_ids, None) for o in sched.update(result)]
        t5 = clock()
        routed = out_dec.decode(encode(RouterOutput(updates=updates)))  # router -> detokenizer
        t6 = clock()
        text, _ = detok.process(routed)
        delta_dec.decode(encode(text))  # detokenizer -> server
        t7 = clock()
        if step >= 20 and len(plan.chunks) == batch:  # steady decode at full batch
            for key, value in (
                ("schedule", t1 - t0),
                ("plan_ipc", t2 - t1),
                ("forward", t3 - t2),
                ("result_ipc", t4 - t3),
                ("update", t5 - t4),
                ("router_out_ipc", t6 - t5),
                ("detokenize", t7 - t6),
            ):
                times[key] += value
            times["steps"] += 1
    n = times.pop("steps")
    ms = {k: 1000.0 * v / n for k, v in times.items()}
    ms["router_step"] = sum(
        ms[k] for k in ("schedule", "plan_ipc", "result_ipc", "update", "router_out_ipc")
    )
    ms["total"] = ms["router_step"] + ms["detokenize"]
    return ms


# ---------------------------------------------------------------------- live processes


async def _drive(url: str, model: str, batch: int, max_tokens: int) -> dict[str, float]:
    import httpx

    body = {
        "model": model,
        "prompt": "bench",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    tokens = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    tokens += 1

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*[one(client) for _ in range(batch)])
        wall = time.perf_counter() - start
        # The router's timing covers its last 256 steps: with max_tokens >> 256 and equal lengths,
        # all of them ran at the full batch.
        status = (await client.get(f"{url}/debug/status")).json()["router"]
    return {
        "router_step_overhead_ms": status["step_overhead_ms"],
        "router_forward_ms": status["step_forward_ms"],
        "client_chunks_per_s": tokens / wall,
        "wall_s": wall,
    }


def bench_live(model_dir: str, batches: list[int], max_tokens: int, port: int) -> dict:
    import httpx

    cmd = [
        sys.executable,
        "-m",
        "appliance.cli",
        "serve",
        model_dir,
        "--port",
        str(port),
        "--runner",
        "ops.bench.bench_overhead:TrivialRunner",
        "--device",
        "cpu",
        "--max-num-seqs",
        str(max(batches)),
        "--max-model-len",
        "8192",
        "--no-access-log",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"appliance exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        return {b: asyncio.run(_drive(url, model, b, max_tokens)) for b in batches}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("inproc", "live"), default="inproc")
    parser.add_argument("--model-dir", default="", help="tokenizer source; default: embedded model")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per batch (inproc)")
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens per stream (live)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    from appliance.assets.resolve import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model_dir))
    batches = [int(b) for b in args.batches.split(",")]
    if args.mode == "inproc":
        results = {b: bench_inproc(model_dir, b, args.steps) for b in batches}
        keys = [
            "schedule",
            "plan_ipc",
            "result_ipc",
            "update",
            "router_out_ipc",
            "router_step",
            "detokenize",
            "total",
        ]
        sys.stdout.write("per-step overhead in ms (trivial forward excluded)\n")
        sys.stdout.write(f"{'batch':>6} " + " ".join(f"{k:>14}" for k in keys) + "\n")
        for b, ms in results.items():
            sys.stdout.write(f"{b:>6} " + " ".join(f"{ms[k]:>14.3f}" for k in keys) + "\n")
    else:
        results = bench_live(model_dir, batches, args.max_tokens, args.port)
        sys.stdout.write(
            f"{'batch':>6} {'router ms/step':>15} {'forward ms':>11} {'client tok/s':>13}\n"
        )
        for b, r in results.items():
            sys.stdout.write(
                f"{b:>6} {r['router_step_overhead_ms']:>15.3f} "
                f"{r['router_forward_ms']:>11.3f} {r['client_chunks_per_s']:>13.1f}\n"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": args.mode, "results": results}, indent=2))


if __name__ == "__main__":
    main()
