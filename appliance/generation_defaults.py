"""Default sampling parameters from a model's generation_config.json: what vLLM (and SGLang) apply
to a request that leaves a field unset, instead of the OpenAI defaults (temperature 1, no top-k or
top-p). Qwen's checkpoints ship temperature 0.6 / top-k 20 / top-p 0.95; a small model sampled at
temperature 1 from the whole vocabulary now and then answers with noise (the embedded default
model: 4 of 1000 answers to the README's question were not "Paris" at temperature 1, 0 of 1000
with its generation_config.json).

`--generation-config auto` (the default) reads the served folder's file, `none` (or vLLM's
spelling, `vllm`) keeps the OpenAI defaults, a folder path reads that folder's. Its
`max_new_tokens`, as in vLLM, caps every request's max_tokens (the `max_tokens` entry). Used by
the server (server/process.py, applied in server/protocol.sampling_params and, the cap, in
server/serving.choice_requests) and by the offline `LLM` when no SamplingParams are given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from appliance.sampling_params import SamplingParams

# generation_config.json keys that are request sampling fields of the same name and meaning
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class GenerationConfigError(ValueError):
    """--generation-config names a file that is missing or holds values no request may take."""


def generation_defaults(model_dir: str | Path, source: str = "auto") -> dict[str, Any]:
    """The sampling fields a request takes when it leaves them unset ({} = the OpenAI defaults).
    `do_sample: false` means greedy (temperature 0), as in transformers; `max_new_tokens` is the
    `max_tokens` entry, a cap rather than a default."""
    if source in ("none", "vllm"):
        return {}
    folder = Path(model_dir) if source == "auto" else Path(source).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if source == "auto":
            return {}
        raise GenerationConfigError(
            f"--generation-config {source}: no generation_config.json in it"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    defaults = {k: data[k] for k in KEYS if data.get(k) is not None}
    if data.get("do_sample") is False:  # greedy: the sampling knobs do not apply
        defaults = {k: v for k, v in defaults.items() if k == "repetition_penalty"}
        defaults["temperature"] = 0.0
    if data.get("max_new_tokens") is not None:
        defaults["max_tokens"] = data["max_new_tokens"]
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise GenerationConfigError(f"{path}: {exc}") from None
    return defaults


def describe(defaults: dict[str, Any]) -> str:
    """One log phrase: `temperature 0.6, top_p 0.95, top_k 20` or `the OpenAI defaults`."""
    if not defaults:
        return "the OpenAI defaults"
    return ", ".join(
        f"max_tokens at most {v}" if k == "max_tokens" else f"{k} {v}" for k, v in defaults.items()
    )


def end_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The ids that end generation (eos): config.json's `eos_token_id` (its text_config's, for a
    vision checkpoint) and generation_config.json's, sorted; () without either. The worker's rule
    (engine/runner.py) and the server's (beam search)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.exists():
            continue
        raw = json.loads(path.read_text())
        if name == "config.json":
            raw = {
                "eos_token_id": (raw.get("text_config") or {}).get(
                    "eos_token_id", raw.get("eos_token_id")
                )
            }
        eos = raw.get("eos_token_id")
        ids.update(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    return tuple(sorted(ids))
