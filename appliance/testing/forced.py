"""Test-only model runner whose generations follow a script: the real forward runs, then the logits
of every sampled row are masked so that the scripted next token is the only choice.

Live-appliance tests (tests/e2e) write the script with `write_scripts()` into a copy of a tiny
checkpoint and start the appliance with `--runner appliance.testing.forced:ForcedRunner`. The
server, detokenizer and parsers see ordinary model output; nothing outside this file knows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.engine.batch import StepBatch
from appliance.engine.runner import ModelRunner
from appliance.engine.sampler import SamplerOutput
from appliance.logging import get_logger
from appliance.messages import StepPlan

log = get_logger(__name__)

SCRIPT_FILE = "forced_outputs.json"  # in the model directory


class ScriptError(ValueError):
    """A target text does not survive tokenize -> decode with the checkpoint's tokenizer."""


@dataclass(frozen=True)
class Script:
    trigger: str  # the request follows this script when its prompt contains `trigger`
    text: str  # the target output (kept for readers of the file; the runner uses token_ids)
    token_ids: tuple[int, ...]  # tokenizer(text); after the last one the runner forces EOS


def write_scripts(model_dir: str | os.PathLike, scripts: Mapping[str, str]) -> list[Script]:
    """Tokenizes each target text (trigger -> text) with the checkpoint's tokenizer, checks that the
    ids decode back to exactly the text, and writes SCRIPT_FILE into `model_dir`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out: list[Script] = []
    for trigger, text in scripts.items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        decoded = tokenizer.decode(ids, skip_special_tokens=False)
        if decoded != text:
            raise ScriptError(f"script {trigger!r}: decode(encode(text)) = {decoded!r} != {text!r}")
        out.append(Script(trigger, text, tuple(ids)))
    payload = {
        "eos_token_id": tokenizer.eos_token_id,
        "scripts": [
            {"trigger": s.trigger, "text": s.text, "token_ids": list(s.token_ids)} for s in out
        ],
    }
    (Path(model_dir) / SCRIPT_FILE).write_text(json.dumps(payload, indent=1))
    return out


def forced_copy(
    model_dir: str | os.PathLike, dest: str | os.PathLike, scripts: Mapping[str, str]
) -> Path:
    """`dest`: a copy of the checkpoint (files symlinked) with `scripts` written into it, so a test
    can force outputs without touching the shared checkpoint."""
    dest = Path(dest)
    dest.mkdir(parents=True)
    for item in Path(model_dir).iterdir():
        (dest / item.name).symlink_to(item)
    write_scripts(dest, scripts)
    return dest


def load_scripts(model_dir: str | os.PathLike) -> tuple[list[Script], int | None]:
    """The scripts and the EOS id forced after a script ends; ([], None) without a file."""
    path = Path(model_dir) / SCRIPT_FILE
    if not path.exists():
        return [], None
    data = json.loads(path.read_text())
    scripts = [Script(s["trigger"], s["text"], tuple(s["token_ids"])) for s in data["scripts"]]
    return scripts, data.get("eos_token_id")


def pick_script(scripts: list[Script], prompt_text: str) -> Script | None:
    """The script whose trigger occurs latest in the prompt (the most recent turn wins)."""
    best, best_at = None, -1
    for script in scripts:
        at = prompt_text.rfind(script.trigger)
        if at > best_at:
            best, best_at = script, at
    return best


class ForcedRunner(ModelRunner):
    """ModelRunner that forces scripted outputs; requests matching no trigger sample normally."""

    def __init__(self, *args, **kwargs) -> None:  # ModelRunner's arguments
        super().__init__(*args, **kwargs)
        from transformers import AutoTokenizer

        self.scripts, eos = load_scripts(self.model_dir)
        self.forced_eos = eos if eos is not None else min(self.eos_token_ids)
        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.forced: dict[int, Script] = {}  # req_slot -> its script
        self.mtp_graphs = None  # scripts are forced in the host sampler: MTP accepts on the host
        log.info("forced runner: %d script(s) from %s", len(self.scripts), SCRIPT_FILE)

    def _admit(self, plan: StepPlan) -> None:
        for slot in plan.released_slots:
            self.forced.pop(slot, None)
        super()._admit(plan)
        for req in plan.new_requests:
            self.forced.pop(req.req_slot, None)
            n_prompt = self.requests.prompt_len_host[req.req_slot]
            prompt = self._tokenizer.decode(req.token_ids[:n_prompt], skip_special_tokens=False)
            script = pick_script(self.scripts, prompt)
            if script is not None:
                self.forced[req.req_slot] = script

    def _sample(self, logits: torch.Tensor, batch: StepBatch) -> SamplerOutput:
        # logits: [S, V], one row per sampled position, in the order the base class builds them
        for chunk, (first, count) in zip(batch.sample_chunks, batch.sample_rows, strict=True):
            script = self.forced.get(chunk.req_slot)
            if script is None:
                continue
            known = self.requests.known_before_sampling(chunk)
            for j in range(count):
                out_index = known + j - self.requests.prompt_len_host[chunk.req_slot]
                target = (
                    script.token_ids[out_index]
                    if out_index < len(script.token_ids)
                    else self.forced_eos
                )
                row = logits[first + j]  # [V]
                keep = row[target].clone()
                row.fill_(float("-inf"))
                row[target] = keep
        return super()._sample(logits, batch)
