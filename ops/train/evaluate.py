"""Held-out evaluation of the default model through a running appliance's HTTP API (openai SDK):
greedy exact match per family with thinking on and off, tool calls checked as parsed by the
server, and the MTP accept length read from /metrics when the server runs with --mtp-step.

    appliance serve --mtp-step 2 --port 8000 &
    python -m ops.train.evaluate --base-url http://127.0.0.1:8000 --per-family 20

`--dump FILE` writes every reply; `--compare FILE` counts replies that differ from an earlier dump
(MTP on against MTP off: the text must be identical).
Exits 1 when an accuracy is under --min-accuracy (or the accept length under --min-accept).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import sys
from collections import defaultdict

import httpx
from PIL import Image

from ops.train import data


def _content(example: data.Example) -> list[dict]:
    messages = []
    pictures = iter(example.pixels)
    for message in example.messages:
        content = message["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "image":
                    buf = io.BytesIO()
                    Image.fromarray(next(pictures)).save(buf, format="PNG")
                    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
                    parts.append({"type": "image_url", "image_url": {"url": url}})
                else:
                    parts.append(part)
            content = parts
        messages.append({"role": message["role"], "content": content})
    return messages


def _mtp_counters(base_url: str) -> tuple[float, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("appliance_mtp_drafts_total"), total("appliance_mtp_accepted_tokens_total")


def ask(client, example: data.Example, thinking: bool, max_tokens: int) -> tuple[bool, dict]:
    kwargs = {"tools": example.tools} if example.tools else {}
    reply = client.chat.completions.create(
        model=client.model_id,
        messages=_content(example),
        temperature=0,
        max_tokens=max_tokens,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        **kwargs,
    )
    message = reply.choices[0].message
    record = {"content": message.content, "tool_calls": None}
    if example.tool_call is not None:
        calls = message.tool_calls or []
        record["tool_calls"] = [[c.function.name, c.function.arguments] for c in calls]
        name, arguments = example.tool_call
        ok = len(calls) == 1 and calls[0].function.name == name
        ok = ok and json.loads(calls[0].function.arguments) == arguments
    else:
        ok = (message.content or "").strip() == example.answer
    return ok, record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default="none")
    p.add_argument("--seed", type=int, default=0, help="the training seed (same held-out split)")
    p.add_argument("--per-family", type=int, default=20)
    p.add_argument("--families", default=",".join(data.FAMILIES))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-accuracy", type=float, default=0.0)
    p.add_argument("--min-accept", type=float, default=0.0)
    p.add_argument("--dump", default="", help="write every reply to this JSON file")
    p.add_argument("--compare", default="", help="a --dump of another run: count differing replies")
    args = p.parse_args(argv)

    from openai import OpenAI

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    client.model_id = client.models.list().data[0].id
    families = [f for f in args.families.split(",") if f]
    examples = data.generate("heldout", args.seed, {f: args.per_family for f in families})
    drafts0, accepted0 = _mtp_counters(args.base_url)
    hits: dict[str, list[int]] = defaultdict(list)
    dump = []
    for example in examples:
        for thinking in (True, False):
            ok, record = ask(client, example, thinking, args.max_tokens)
            hits[f"{example.family}/{'think' if thinking else 'no_think'}"].append(int(ok))
            dump.append({"family": example.family, "thinking": thinking, "ok": ok, **record})
    drafts1, accepted1 = _mtp_counters(args.base_url)
    failed = False
    for key in sorted(hits):
        acc = sum(hits[key]) / len(hits[key])
        failed |= acc < args.min_accuracy
        print(f"{key:24s} {100 * acc:5.1f} %  ({len(hits[key])} prompts)")
    if drafts1 > drafts0:
        accept = 1 + (accepted1 - accepted0) / (drafts1 - drafts0)
        failed |= accept < args.min_accept
        print(f"MTP mean accept length (1 + accepted / drafts): {accept:.2f}")
    else:
        print("MTP off on this server (no drafts counted)")
        failed |= args.min_accept > 0
    if args.dump:
        with open(args.dump, "w") as out:
            json.dump(dump, out, indent=1)
    if args.compare:
        with open(args.compare) as f:
            other = json.load(f)
        differ = sum(a != b for a, b in zip(dump, other)) + abs(len(dump) - len(other))
        print(f"replies differing from {args.compare}: {differ} of {len(dump)}")
        failed |= differ > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
