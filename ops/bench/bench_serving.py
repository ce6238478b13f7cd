"""OpenAI-compatible serving load generator: TTFT, TPOT, ITL and E2E latency percentiles, request
and token throughput, printed as a table and optionally written as JSON.
  python ops/bench/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency 16 \
      --num-prompts 160 --input-len 256 --output-len 128 --ignore-eos --json out.json
  python ops/bench/bench_serving.py --request-rate 4 --dataset file --prompt-file prompts.jsonl
  python ops/bench/bench_serving.py --concurrency 16 --response-format json_schema --ignore-eos

`--response-format json_object|json_schema` constrains every request (structured outputs): chat
requests send OpenAI's `response_format` (thinking off, so the grammar applies from the first
token), completions send `structured_outputs`; `--json-schema FILE` replaces the built-in schema
(an open-ended list of records, so a long output stays inside the grammar).

Metric definitions follow `vllm bench serve`: TTFT = send -> first streamed content; ITL = every gap
between streamed content chunks, pooled over requests; TPOT = (E2E - TTFT) / (output tokens - 1) per
request; output tokens come from the server's `usage` (stream_options.include_usage). Works against
any OpenAI-compatible server (this appliance, vLLM, SGLang).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point number group problem fact system program question government company"
).split()


# Open-ended on purpose: a record list never has to end, so --output-len tokens stay constrained.
BUILTIN_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "score": {"type": "number", "minimum": 0, "maximum": 100},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["name", "score", "kind", "tags"],
            },
        }
    },
    "required": ["records"],
}


def constraint_fields(args) -> dict:
    """The request-body fields of --response-format (none for text)."""
    if args.response_format == "text":
        return {}
    schema = json.loads(args.json_schema.read_text()) if args.json_schema else BUILTIN_SCHEMA
    if args.endpoint == "chat":
        fmt: dict = {"type": args.response_format}
        if args.response_format == "json_schema":
            fmt["json_schema"] = {"name": "bench", "schema": schema}
        return {"response_format": fmt, "chat_template_kwargs": {"enable_thinking": False}}
    if args.response_format == "json_object":
        return {"structured_outputs": {"json_object": True}}
    return {"structured_outputs": {"json": schema}}


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (prefix cache)
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# ---------------------------------------------------------------------- prompts


def random_prompts(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rng: random.Random,
    vocab_size: int | None,
) -> list[tuple[object, int]]:
    """(prompt, max_tokens) pairs; token-id prompts of exact length when the vocab size is known
    (completions endpoint), else random words (about one token each)."""
    out = []
    for _ in range(n):
        n_in = max(1, int(input_len * rng.uniform(range_ratio, 1.0)))
        n_out = max(1, int(output_len * rng.uniform(range_ratio, 1.0)))
        if vocab_size:
            prompt: object = [rng.randrange(100, vocab_size) for _ in range(n_in)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
        out.append((prompt, n_out))
    return out


def file_prompts(path: Path, n: int, output_len: int) -> list[tuple[object, int]]:
    """One prompt per line (.txt) or per JSON object with "prompt" (and optional "max_tokens")."""
    items: list[tuple[object, int]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            obj = json.loads(line)
            items.append((obj["prompt"], int(obj.get("max_tokens", output_len))))
        else:
            items.append((line, output_len))
    if not items:
        raise SystemExit(f"{path}: no prompts")
    return [items[i % len(items)] for i in range(n)]


# ---------------------------------------------------------------------- one request


async def run_request(
    client: httpx.AsyncClient, args, model: str, prompt: object, max_tokens: int
) -> RequestResult:
    body: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": args.temperature,
    }
    if args.top_k:
        body["top_k"] = args.top_k
    if args.top_p < 1.0:
        body["top_p"] = args.top_p
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(constraint_fields(args))
    if args.endpoint == "chat" and isinstance(prompt, list) and isinstance(prompt[0], dict):
        body["messages"] = prompt  # a whole conversation (bench_prefix.py replay --chat)
        path = "/v1/chat/completions"
    elif args.endpoint == "chat":
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    result = RequestResult()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = (
                        choice.get("text") or delta.get("content") or delta.get("reasoning_content")
                    )
                    if piece:
                        now = time.perf_counter()
                        if last is None:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last = now
        result.e2e_s = time.perf_counter() - start
        result.ok = last is not None
        if not result.ok:
            result.error = "no content streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# ---------------------------------------------------------------------- load


async def run_load(args, model: str, work: list[tuple[object, int]]) -> tuple[list, float]:
    limit = args.concurrency or len(work)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(
        base_url=args.base_url, timeout=args.timeout, limits=limits
    ) as client:
        for prompt, max_tokens in work[: args.warmup]:
            await run_request(client, args, model, prompt, max_tokens)

        async def guarded(prompt, max_tokens):
            async with sem:
                return await run_request(client, args, model, prompt, max_tokens)

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(guarded(prompt, max_tokens)))
            if args.request_rate and not math.isinf(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def percentiles(values: list[float], points: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p:g}": float("nan") for p in points}}
    ordered = sorted(values)
    out = {"mean": sum(ordered) / len(ordered)}
    for p in points:
        rank = min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))
        out[f"p{p:g}"] = ordered[rank]
    return out


def summarize(results: list[RequestResult], duration: float, points: list[float]) -> dict:
    ok = [r for r in results if r.ok]
    inp = sum(r.prompt_tokens for r in ok)
    outp = sum(r.output_tokens for r in ok)
    ms = lambda xs: {k: 1000.0 * v for k, v in percentiles(xs, points).items()}  # noqa: E731
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_tok_s": inp / duration,
        "output_tok_s": outp / duration,
        "total_tok_s": (inp + outp) / duration,
        "total_input_tokens": inp,
        "total_output_tokens": outp,
        "ttft_ms": ms([r.ttft_s for r in ok]),
        "tpot_ms": ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": ms([x for r in ok for x in r.itl_s]),
        "e2el_ms": ms([r.e2e_s for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def render_table(summary: dict) -> str:
    lines = [
        f"{'completed / failed':<28}{summary['completed']} / {summary['failed']}",
        f"{'duration (s)':<28}{summary['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{summary['request_throughput']:.2f}",
        f"{'input tokens/s':<28}{summary['input_tok_s']:.1f}",
        f"{'output tokens/s':<28}{summary['output_tok_s']:.1f}",
        f"{'total tokens/s':<28}{summary['total_tok_s']:.1f}",
    ]
    keys = [k for k in summary["ttft_ms"] if k != "mean"]
    lines.append(f"{'(ms)':<8}{'mean':>10}" + "".join(f"{k:>10}" for k in keys))
    for name in ("ttft", "tpot", "itl", "e2el"):
        row = summary[f"{name}_ms"]
        lines.append(
            f"{name.upper():<8}{row['mean']:>10.2f}" + "".join(f"{row[k]:>10.2f}" for k in keys)
        )
    for err in summary["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="", help="default: the first id from /v1/models")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="completions")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=0, help="max in flight (0 = no limit)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson req/s (inf)")
    p.add_argument("--dataset", choices=("random", "file"), default="random")
    p.add_argument("--prompt-file", type=Path)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=1.0, help="lengths in [ratio*len, len]")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help="random token-id prompts of exact length (completions endpoint)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0, help="sent when > 0 (Qwen's default: 20)")
    p.add_argument("--top-p", type=float, default=1.0, help="sent when < 1 (Qwen's: 0.95)")
    p.add_argument(
        "--response-format",
        choices=("text", "json_object", "json_schema"),
        default="text",
        help="constrain every request (structured outputs)",
    )
    p.add_argument("--json-schema", type=Path, help="schema file for json_schema (else built in)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and ignored) first")
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, help="write the summary and the arguments here")
    args = p.parse_args()
    model = args.model or httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
    rng = random.Random(args.seed)
    if args.dataset == "file":
        if args.prompt_file is None:
            p.error("--dataset file needs --prompt-file")
        work = file_prompts(args.prompt_file, args.num_prompts, args.output_len)
    else:
        vocab = args.vocab_size if args.endpoint == "completions" else 0
        work = random_prompts(
            args.num_prompts, args.input_len, args.output_len, args.range_ratio, rng, vocab or None
        )
    results, duration = asyncio.run(run_load(args, model, work))
    points = [float(x) for x in args.percentiles.split(",")]
    summary = summarize(results, duration, points)
    sys.stdout.write(render_table(summary) + "\n")
    if args.json:
        config = {
            k: (str(v) if isinstance(v, Path) or v == math.inf else v)
            for k, v in vars(args).items()
        }
        args.json.write_text(
            json.dumps(
                {
                    "config": config,
                    "model": model,
                    "summary": summary,
                    "requests": [asdict(r) for r in results],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
