"""Structured-output grammar cost on a real tokenizer: tokenizer setup, compile time of a large
generated JSON schema (and of a few small ones), and the per-token mask time over a random walk.
  python ops/bench/bench_grammar.py --fields 200                    # Qwen3.5 tokenizer (248k)
  python ops/bench/bench_grammar.py --tokenizer /models/Qwen3.5-27B --fields 500 --json out.json

CPU only (the grammar engine runs on the host); uses the appliance's own compiler
(appliance/grammars.py) and worker matchers (appliance/engine/guided.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from appliance.engine.guided import GuidedDecoding
from appliance.grammars import GrammarCompiler
from appliance.messages import Guide
from appliance_kernels.token_bitmask import apply_token_bitmask


def large_schema(fields: int) -> dict:
    """An object of `fields` properties cycling through the feature kinds (nested objects, arrays,
    enums, bounded numbers, unions), every other one required."""
    kinds = [
        {"type": "string", "maxLength": 32},
        {"type": "integer", "minimum": -1000, "maximum": 1000},
        {"type": "number", "minimum": 0, "maximum": 1},
        {"enum": [f"v{j}" for j in range(12)]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": ["string", "null"]}},
            "required": ["x"],
        },
        {"type": ["integer", "boolean"]},
    ]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)[::2]}


SMALL = {
    "two_fields": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "tags": {"type": "array"}},
            },
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
    },
}


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    from appliance.testing.tokenizers import build_qwen_tokenizer

    out = Path(tempfile.mkdtemp(prefix="qwen35-tok-"))
    return AutoTokenizer.from_pretrained(str(build_qwen_tokenizer(out, "qwen3.5")))


def mask_walk(guided: GuidedDecoding, vocab: int, steps: int, seed: int) -> list[float]:
    """Seconds per mask over a random walk (random logits, masked, argmax)."""
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mask = guided.bitmask([(0, [])])
        times.append(time.perf_counter() - start)
        logits = apply_token_bitmask(torch.randn(1, vocab, generator=gen), mask)
        guided.advance(0, [int(logits.argmax())])
        if guided.terminated(0):
            break
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", help="a tokenizer folder (default: the Qwen3.5 vocabulary)")
    p.add_argument("--vocab-size", type=int, default=248320, help="logits width")
    p.add_argument("--fields", type=int, default=200, help="properties of the large schema")
    p.add_argument("--steps", type=int, default=300, help="masked tokens per schema")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    tok = load_tokenizer(args.tokenizer)
    compiler = GrammarCompiler(lambda: tok, args.vocab_size)
    start = time.perf_counter()
    compiler.warm_up()
    results: dict = {"tokenizer_setup_s": time.perf_counter() - start, "schemas": {}}
    schemas = {**SMALL, f"large_{args.fields}": large_schema(args.fields)}
    for name, schema in schemas.items():
        guide = Guide("json_schema", json.dumps(schema))
        start = time.perf_counter()
        compiler.submit(guide).result()
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        compiler.submit(guide).result()
        cached_s = time.perf_counter() - start
        guided = GuidedDecoding(lambda: tok, args.vocab_size, [tok.eos_token_id or 0], compiler)
        guided.admit(0, guide, [])
        times = mask_walk(guided, args.vocab_size, args.steps, seed=0)
        results["schemas"][name] = {
            "compile_s": compile_s,
            "cached_s": cached_s,
            "mask_mean_us": statistics.mean(times) * 1e6,
            "mask_p99_us": sorted(times)[int(0.99 * (len(times) - 1))] * 1e6,
            "masked_tokens": len(times),
        }
    sys.stdout.write(f"tokenizer setup {results['tokenizer_setup_s']:.2f} s\n")
    sys.stdout.write(
        f"{'schema':<16}{'compile ms':>12}{'cached ms':>11}{'mask us':>9}{'p99 us':>8}\n"
    )
    for name, r in results["schemas"].items():
        sys.stdout.write(
            f"{name:<16}{r['compile_s'] * 1e3:>12.1f}{r['cached_s'] * 1e3:>11.3f}"
            f"{r['mask_mean_us']:>9.0f}{r['mask_p99_us']:>8.0f}\n"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
