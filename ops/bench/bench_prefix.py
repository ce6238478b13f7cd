"""Prefix-cache benchmark against a served model (completions endpoint, token-id prompts).

  hitmiss: TTFT of prompts that share a cached prefix (hit) vs prompts with a fresh prefix of the
    same length (miss), one request at a time:
      python ops/bench/bench_prefix.py hitmiss --prefix-len 8192 --new-len 128 --repeats 5
  replay: multi-turn conversations, each turn re-sending the conversation plus new tokens; hit rate
    (cached / prompt tokens, from usage.prompt_tokens_details.cached_tokens), TTFT and TPOT. Run it
    once against a server with prefix caching and once with --no-prefix-caching:
      python ops/bench/bench_prefix.py replay --conversations 32 --turns 5 --turn-len 1024
    With --chat the turns go through /v1/chat/completions as message lists (random words, about
    one token each), so the chat template re-renders each earlier answer as clients cause it to.

Answers are not fed back as generated (the endpoint returns text, not token ids): each turn
appends a stand-in answer of --output-len random ids, so a turn hits the previous turn's prompt, not
its answer (a real client re-sending the answer hits that too). On Qwen3.5 a hit needs a GDN state
snapshot: keep --prefix-len a multiple of the server's --snapshot-interval (2048) for hitmiss.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import httpx
from bench_serving import RequestResult, percentiles, run_request


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


WORDS = "river stone cloud market window orange thunder garden pencil silver harbor candle".split()


def _ms(values: list[float]) -> dict[str, float]:
    return {k: 1000.0 * v for k, v in percentiles(values, [50.0, 90.0, 99.0]).items()}


async def hitmiss(args, client: httpx.AsyncClient, model: str) -> dict:
    """Per repeat: a miss (fresh prefix + suffix) and a hit (the shared prefix + a fresh suffix)."""
    rng = random.Random(args.seed)
    shared = _ids(rng, args.prefix_len, args.vocab_size)
    warm = await run_request(
        client, args, model, shared + _ids(rng, args.new_len, args.vocab_size), args.output_len
    )
    misses: list[RequestResult] = []
    hits: list[RequestResult] = []
    for _ in range(args.repeats):
        fresh = _ids(rng, args.prefix_len + args.new_len, args.vocab_size)
        misses.append(await run_request(client, args, model, fresh, args.output_len))
        prompt = shared + _ids(rng, args.new_len, args.vocab_size)
        hits.append(await run_request(client, args, model, prompt, args.output_len))
    bad = [r.error for r in [warm, *misses, *hits] if not r.ok]
    miss_ttft, hit_ttft = _ms([r.ttft_s for r in misses]), _ms([r.ttft_s for r in hits])
    return {
        "errors": bad[:5],
        "miss_ttft_ms": miss_ttft,
        "hit_ttft_ms": hit_ttft,
        "speedup_mean": miss_ttft["mean"] / hit_ttft["mean"] if hit_ttft["mean"] else 0.0,
        "hit_cached_tokens": [r.cached_tokens for r in hits],
        "miss_cached_tokens": [r.cached_tokens for r in misses],
    }


async def replay(args, client: httpx.AsyncClient, model: str) -> dict:
    """`conversations` run at once, each turn after the previous one's answer."""
    results: list[list[RequestResult]] = [[] for _ in range(args.turns)]

    async def conversation(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        if args.chat:
            prompt = [{"role": "user", "content": f"{index} " + _words(rng, args.first_len)}]
        else:
            prompt = _ids(rng, args.first_len, args.vocab_size)
        for turn in range(args.turns):
            result = await run_request(client, args, model, prompt, args.output_len)
            results[turn].append(result)
            if args.chat:  # a stand-in answer, as the template renders a past reply
                prompt = prompt + [
                    {"role": "assistant", "content": _words(rng, args.output_len)},
                    {"role": "user", "content": _words(rng, args.turn_len)},
                ]
                continue
            answer = _ids(rng, args.output_len, args.vocab_size)  # the stand-in answer
            prompt = prompt + answer + _ids(rng, args.turn_len, args.vocab_size)

    start = asyncio.get_running_loop().time()
    await asyncio.gather(*(conversation(i) for i in range(args.conversations)))
    duration = asyncio.get_running_loop().time() - start
    ok = [r for turn in results for r in turn if r.ok]
    later = [r for turn in results[1:] for r in turn if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": sum(len(t) for t in results) - len(ok),
        "errors": sorted({r.error for t in results for r in t if not r.ok})[:5],
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "hit_rate_turns_2plus": (
            sum(r.cached_tokens for r in later) / max(1, sum(r.prompt_tokens for r in later))
        ),
        "ttft_ms": _ms([r.ttft_s for r in ok]),
        "ttft_turns_2plus_ms": _ms([r.ttft_s for r in later]),
        "tpot_ms": _ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "output_tok_s": sum(r.output_tokens for r in ok) / duration if duration else 0.0,
    }


def render(mode: str, summary: dict) -> str:
    def row(name: str, values: dict[str, float]) -> str:
        return f"{name:<22}" + "".join(f"{k} {v:9.2f}  " for k, v in values.items())

    lines = []
    if mode == "hitmiss":
        lines += [row("miss TTFT (ms)", summary["miss_ttft_ms"])]
        lines += [row("hit TTFT (ms)", summary["hit_ttft_ms"])]
        lines += [f"{'speedup (mean TTFT)':<22}{summary['speedup_mean']:.1f}x"]
        lines += [f"{'hit cached tokens':<22}{summary['hit_cached_tokens']}"]
    else:
        lines += [
            f"{'completed / failed':<22}{summary['completed']} / {summary['failed']}",
            f"{'hit rate':<22}{100 * summary['hit_rate']:.1f}% (turns 2+: "
            f"{100 * summary['hit_rate_turns_2plus']:.1f}%)",
            row("TTFT (ms)", summary["ttft_ms"]),
            row("TTFT turns 2+ (ms)", summary["ttft_turns_2plus_ms"]),
            row("TPOT (ms)", summary["tpot_ms"]),
            f"{'output tokens/s':<22}{summary['output_tok_s']:.1f}",
        ]
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)


async def main_async(args) -> dict:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        run = hitmiss if args.mode == "hitmiss" else replay
        return await run(args, client, model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("hitmiss", "replay"))
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="", help="default: the first id from /v1/models")
    p.add_argument("--vocab-size", type=int, default=240000, help="random ids below this")
    p.add_argument("--output-len", type=int, default=8, help="tokens generated per request")
    p.add_argument("--prefix-len", type=int, default=8192, help="hitmiss: shared prefix tokens")
    p.add_argument("--new-len", type=int, default=128, help="hitmiss: new tokens after it")
    p.add_argument("--repeats", type=int, default=5, help="hitmiss: hit and miss requests each")
    p.add_argument("--conversations", type=int, default=32, help="replay: run at once")
    p.add_argument("--turns", type=int, default=5, help="replay: turns per conversation")
    p.add_argument("--first-len", type=int, default=1024, help="replay: first prompt's tokens")
    p.add_argument("--turn-len", type=int, default=1024, help="replay: new tokens per turn")
    p.add_argument("--chat", action="store_true", help="replay: through /v1/chat/completions")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, help="write the summary and the arguments here")
    args = p.parse_args()
    args.ignore_eos, args.response_format = True, "text"  # what run_request reads
    args.endpoint = "chat" if args.chat else "completions"
    summary = asyncio.run(main_async(args))
    sys.stdout.write(render(args.mode, summary) + "\n")
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
