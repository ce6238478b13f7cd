"""Applies flag_aliases.FOREIGN_FLAGS: vLLM's and SGLang's launch flags become this appliance's
settings, an INFO line for each one that changes nothing here, or one error line; the flags read
together (--speculative-config and its dotted keys, SGLang's four --speculative-* flags,
--limit-mm-per-prompt) have their readers here. Called by cli.py (`appliance serve` flags,
`add_foreign_flags` / `translate_args`) and offline/options.py (the offline LLM's keywords of the
same names, `translate_keywords`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.flag_aliases import FOREIGN_FLAGS, MTP_ALGORITHMS, MTP_METHODS, ForeignFlag


@dataclass
class Translated:
    settings: dict[str, Any] = field(default_factory=dict)  # our config field -> value
    sources: dict[str, str] = field(default_factory=dict)  # field -> the foreign flag that set it
    notes: list[str] = field(default_factory=list)  # one INFO line per flag ignored here


def keyword(flag: str) -> str:
    """A flag's offline keyword: `--context-length` is `context_length`."""
    return flag.lstrip("-").replace("-", "_")


def _dest(entry: ForeignFlag) -> str:
    return "foreign_" + keyword(entry.flags[0])


def add_foreign_flags(parser: argparse.ArgumentParser) -> None:
    """Adds every foreign flag to `appliance serve`, in a --help section of its own."""
    group = parser.add_argument_group(
        "vLLM and SGLang flags", "translated to this appliance's (docs/operations.md section 7)"
    )
    for entry in FOREIGN_FLAGS:
        kwargs: dict[str, Any] = {"dest": _dest(entry), "default": None}
        refused = f"; refused: {entry.refused}" if entry.refused else ""
        kwargs["help"] = f"{entry.origin}: {entry.why}{refused}".replace("%", "%%")
        if entry.takes == "switch":
            kwargs["action"] = "store_true"
        elif entry.takes == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=entry.type, metavar=entry.metavar, choices=entry.choices or None)
        group.add_argument(*entry.flags, **kwargs)


def _json_object(value: Any, flag: str) -> dict:
    """A JSON object given as text (command line) or as a dict (offline keyword)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{flag}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object")
    return dict(value)


def _whole(value: Any, what: str) -> int:
    """An integer >= 0, also from the text of a dotted flag (`--limit-mm-per-prompt.video 0`)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} {value!r}: expected an integer >= 0")
    return value


def _vllm_speculative(given: dict[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """--speculative-config JSON (and its dotted keys) -> --mtp-step (and its
    disable_by_batch_size -> --mtp-disable-batch-size)."""
    flag = name("--speculative-config")
    spec = _json_object(given.get("--speculative-config", {}), flag)
    for dotted in ("--speculative-config.method", "--speculative-config.num_speculative_tokens"):
        if dotted in given:
            spec[dotted.partition(".")[2]] = given[dotted]
    accepted = (
        f"method ({', '.join(MTP_METHODS)}), num_speculative_tokens and disable_by_batch_size"
    )
    if unknown := sorted(set(spec) - {"method", "num_speculative_tokens", "disable_by_batch_size"}):
        raise ValueError(
            f"{flag}: {', '.join(unknown)} not taken: drafts come from the checkpoint's own MTP "
            f"head; the keys taken are {accepted}"
        )
    method = spec.get("method")
    if not isinstance(method, str) or method.lower() not in MTP_METHODS:
        raise ValueError(
            f"{flag}: method {method!r} not supported: only the checkpoint's own MTP head drafts "
            f"here ({', '.join(MTP_METHODS)}); ngram, eagle / eagle3 and draft models are not"
        )
    steps = _whole(spec.get("num_speculative_tokens", 1), f"{flag}: num_speculative_tokens")
    out = {"mtp_step": steps}
    if spec.get("disable_by_batch_size") is not None:  # vLLM: null = never
        limit = _whole(spec["disable_by_batch_size"], f"{flag}: disable_by_batch_size")
        if limit < 1:
            raise ValueError(f"{flag}: disable_by_batch_size {limit}: expected an integer >= 1")
        out["mtp_disable_batch_size"] = limit
    return out


def _sglang_speculative(given: dict[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """--speculative-algorithm NEXTN + --speculative-num-steps N (+ topk 1, N + 1 draft tokens)
    -> --mtp-step N."""
    algo, steps = given.get("--speculative-algorithm"), given.get("--speculative-num-steps")
    topk = given.get("--speculative-eagle-topk")
    drafts = given.get("--speculative-num-draft-tokens")
    algo_flag, steps_flag = name("--speculative-algorithm"), name("--speculative-num-steps")
    if algo is None:
        others = ", ".join(name(flag) for flag in given)
        raise ValueError(
            f"{others} without {algo_flag}: SGLang drafts nothing then; add {algo_flag} NEXTN "
            f"(or use {name('--mtp-step')})"
        )
    if str(algo).upper() not in MTP_ALGORITHMS:
        raise ValueError(
            f"{algo_flag} {algo}: not supported: only the checkpoint's own MTP head drafts here "
            f"({', '.join(MTP_ALGORITHMS)} without a draft model)"
        )
    if steps is None:
        raise ValueError(
            f"{algo_flag} {algo}: give {steps_flag} N (the drafts per step); SGLang's own choice "
            "may be a tree of drafts, which is not supported here"
        )
    if topk is not None and topk != 1:
        raise ValueError(
            f"{name('--speculative-eagle-topk')} {topk}: not supported: MTP drafts one chain "
            "here, not a tree; give 1"
        )
    if drafts is not None and drafts != steps + 1:
        raise ValueError(
            f"{name('--speculative-num-draft-tokens')} {drafts}: {steps_flag} {steps} verifies "
            f"{steps + 1} tokens a step (the drafts and one more); give {steps + 1} or leave it out"
        )
    return {"mtp_step": steps}


def _limit_mm(given: dict[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """--limit-mm-per-prompt {"image": n, "video": 0} -> --max-images-per-request n (n = 0:
    --no-vision)."""
    flag = name("--limit-mm-per-prompt")
    limits = _json_object(given.get("--limit-mm-per-prompt", {}), flag)
    for dotted in ("--limit-mm-per-prompt.image", "--limit-mm-per-prompt.video"):
        if dotted in given:
            limits[dotted.partition(".")[2]] = given[dotted]
    counts = {}
    for modality, limit in limits.items():
        if modality not in ("image", "video", "audio"):
            raise ValueError(f"{flag}: {modality!r}: expected image, video or audio")
        # vLLM's newer form {"count": n, "width": ..., "height": ...}: the size is a profiling
        # hint; the visual server measures its worst case itself
        count = limit.get("count") if isinstance(limit, dict) else limit
        counts[modality] = _whole(count, f"{flag}: {modality}")
    for modality in ("video", "audio"):
        if counts.get(modality):
            raise ValueError(
                f"{flag}: {modality} {counts[modality]}: not supported: this appliance takes "
                f"images and text, no {modality}; give {modality} 0 or leave it out"
            )
    if "image" not in counts:
        return {}
    if counts["image"] == 0:
        return {"vision": False}
    return {"max_images_per_request": counts["image"]}


# flags read together: group name -> reader(given {first spelling: value}, name) -> settings;
# `name(flag)` spells a flag as the caller takes it (`--flag` or `keyword`), for its messages
GROUP_READERS: dict[str, Callable[[dict[str, Any], Callable[[str], str]], dict[str, Any]]] = {
    "vllm_speculative": _vllm_speculative,
    "sglang_speculative": _sglang_speculative,
    "limit_mm": _limit_mm,
}


def translate(
    given: dict[ForeignFlag, Any],
    spell: Callable[[ForeignFlag, Any], str],
    name: Callable[[str], str],
) -> Translated:
    """given: each foreign flag given -> its value. spell(entry, value) writes it in a message,
    name(flag) a flag alone. Raises ValueError (one line) for a refused value or two flags that
    set one field to different values."""
    out = Translated()
    groups: dict[str, dict[ForeignFlag, Any]] = {}
    for entry, value in given.items():
        if entry.group:
            groups.setdefault(entry.group, {})[entry] = value
            continue
        shown = spell(entry, value)
        try:
            settings = entry.read(value) if entry.read else {}
        except ValueError as exc:
            raise ValueError(f"{shown}: {exc}") from None
        if not settings:
            out.notes.append(f"{shown}: ignored: {entry.why}")
        _merge(out, settings, shown)
    for group, members in groups.items():
        values = {entry.flags[0]: value for entry, value in members.items()}
        shown = " ".join(spell(entry, value) for entry, value in members.items())
        _merge(out, GROUP_READERS[group](values, name), shown)
    return out


def _merge(out: Translated, settings: dict[str, Any], shown: str) -> None:
    for name, value in settings.items():
        if name in out.settings and out.settings[name] != value:
            raise ValueError(
                f"{out.sources[name]} and {shown} disagree on {name} "
                f"({out.settings[name]!r} vs {value!r}); give one"
            )
        out.settings[name] = value
        out.sources.setdefault(name, shown)


def check_ours(out: Translated, ours: dict[str, Any], spell: Callable[[str, Any], str]) -> None:
    """A field set both by a foreign flag and by our own (`ours`: field -> value given, None if
    not) must agree; ValueError naming both otherwise."""
    for name, value in out.settings.items():
        mine = ours.get(name)
        if mine is not None and mine != value:
            raise ValueError(
                f"{out.sources[name]} and {spell(name, mine)} disagree on {name} "
                f"({value!r} vs {mine!r}); give one"
            )


def _spell_flag(entry: ForeignFlag, value: Any) -> str:
    if entry.takes == "switch":
        return entry.flags[0]
    if entry.takes == "bool":
        return entry.flags[0] if value else "--no-" + entry.flags[0][2:]
    return f"{entry.flags[0]} {value}"


def _spell_our_flag(name: str, value: Any) -> str:
    if name == "model_dir":
        return f"MODEL {value}"
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value}"


def translate_args(args: argparse.Namespace) -> Translated:
    """The foreign flags of a parsed `appliance serve` command line, written into `args` as the
    flags of ours they stand for; ValueError (one line naming the flags) for a refused one."""
    given = {}
    for entry in FOREIGN_FLAGS:
        value = getattr(args, _dest(entry), None)
        if value is not None:
            given[entry] = value
    out = translate(given, _spell_flag, lambda flag: flag)
    # our flags default to None when not given; MODEL to ""
    ours = {name: getattr(args, name) for name in out.settings}
    ours = {name: value for name, value in ours.items() if value not in (None, "")}
    check_ours(out, ours, _spell_our_flag)
    for name, value in out.settings.items():
        setattr(args, name, value)
    return out


def translate_keywords(options: dict[str, Any]) -> Translated:
    """The offline LLM's foreign keywords (`speculative_config={...}`, `enable_chunked_prefill`,
    SGLang's `context_length` ...): removed from `options`; their settings checked against the
    options of ours given there, not written into them (the caller places them)."""
    given = {}
    for entry in FOREIGN_FLAGS:
        for key in map(keyword, entry.flags if entry.offline else ()):
            if key in options:
                given[entry] = options.pop(key)
    out = translate(given, lambda entry, value: f"{keyword(entry.flags[0])}={value!r}", keyword)
    check_ours(out, options, lambda name, value: f"{name}={value!r}")
    return out
