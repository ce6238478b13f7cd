"""Which weights are fp8 and how: parsed once from a checkpoint's `quantization_config` (Qwen
"-FP8" block checkpoints, llm-compressor / compressed-tensors FP8, NVIDIA ModelOpt FP8, whose
older exports keep it in `hf_quant_config.json`: `checkpoint_quant_config`) or from
`--quantization fp8` (online: bf16 weights quantised per output channel at load). Called by
`appliance.models.config.load_text_config` and the CLI's preflight; the layers ask
`QuantConfig.for_module`.

Anything outside what is listed in SUPPORTED raises `UnsupportedQuantization` naming the field.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config import quant_method_name

SCHEMES = ("fp8_channel", "fp8_block")  # per-output-channel weight scales / [bn, bk] tile scales
ONLINE = ("fp8",)  # values of --quantization that quantise a 16-bit checkpoint at load
# --quantization naming the checkpoint's own method
CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "modelopt")
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")  # per-tensor static / per-channel dynamic
BLOCK_SIZES = (16, 32, 64, 128)  # accepted block_n / block_k (Qwen's checkpoints use 128 x 128)
SUPPORTED = (
    'quant_method "fp8" (fmt e4m3, activation_scheme dynamic or static, weight_block_size [bn, bk] '
    f"with bn, bk in {BLOCK_SIZES}, or none for per-tensor scales) and "
    '"compressed-tensors" (format float-quantized: 8-bit float symmetric static weights with '
    "strategy channel, tensor or block; 8-bit float activations, dynamic or static per tensor) "
    f'and "modelopt" (quant_algo {" or ".join(MODELOPT_ALGOS)})'
)
# Online fp8 keeps what Qwen's own fp8 checkpoints keep in bf16: routers, gates and the
# per-head GDN projections (a few rows each; quantising them saves nothing and costs accuracy).
ONLINE_IGNORE = (
    "lm_head",
    r"re:.*\.mlp\.gate$",
    r"re:.*\.shared_expert_gate$",
    r"re:.*\.linear_attn\.in_proj_[ab]$",
)


class UnsupportedQuantization(ValueError):
    pass


@dataclass(frozen=True)
class QuantConfig:
    scheme: str  # one of SCHEMES
    block: tuple[int, int] | None  # (block_n, block_k) for fp8_block
    online: bool  # weights arrive in bf16/fp32 and are quantised once loaded
    # module names kept unquantised: exact / dotted names, "re:<regex>" or shell wildcards (`*`)
    ignore: tuple[str, ...]
    source: str  # "fp8", "compressed-tensors", "modelopt" or "online": named in messages
    # the checkpoint calibrated static per-tensor activation scales (`input_scale`): the loader
    # checks and reads past them; activations are quantised per token as for dynamic ones (see
    # appliance/models/quant_weights.py InputScales)
    static_inputs: bool = False
    # compressed-tensors' config_group `targets`: only the modules they name are quantised
    # ("Linear", its default, names every linear layer; else "re:<regex>" or module names)
    targets: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the startup log: the scheme, where it came from, what runs at run time."""
        if self.online:
            return (
                "fp8 weights, one scale per output channel, quantised at load (--quantization fp8)"
            )
        if self.scheme == "fp8_block":
            weights = f"fp8 weights with {self.block[0]} x {self.block[1]} block scales"
        else:
            weights = "fp8 weights with per-channel / per-tensor scales"
        parts = [f"{weights} from the checkpoint ({self.source})"]
        if self.static_inputs:
            parts.append("its static input_scales read past")
        if self.ignore:
            parts.append(f"{len(self.ignore)} ignore-list entries kept in 16-bit")
        return "; ".join(parts)

    def skips(self, name: str) -> bool:
        """Whether checkpoint module `name` stays unquantised. Our `model.layers.*` names are also
        tried in the VLM form `model.language_model.layers.*`."""
        forms = {name, re.sub(r"^model\.", "model.language_model.", name)}
        if any(_matches(pattern, form) for pattern in self.ignore for form in forms):
            return True
        if not self.targets or "Linear" in self.targets:  # "Linear": every linear layer
            return False
        return not any(_matches(target, form) for target in self.targets for form in forms)

    def for_module(self, *names: str) -> QuantConfig | None:
        """This config if the checkpoint modules `names` (the parts of one fused layer) are all
        quantised, None if none is; a mix cannot share one GEMM and is refused."""
        skipped = [self.skips(n) for n in names]
        if all(skipped):
            return None
        if not any(skipped):
            return self
        kept = [n for n, s in zip(names, skipped) if s]
        raise UnsupportedQuantization(
            f"{self.source} quantization: {', '.join(kept)} unquantised but "
            f"{', '.join(n for n in names if n not in kept)} quantised; they are fused into one "
            "layer here and must share one scheme"
        )


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if "*" in pattern or "?" in pattern:  # ModelOpt's "*.mlp.gate", "model.visual*"
        return fnmatch.fnmatchcase(name, pattern)
    return f".{pattern}." in f".{name}."


def checkpoint_quant_config(model_dir: str | Path, raw: dict[str, Any]) -> dict[str, Any]:
    """config.json's dict `raw`, with a ModelOpt export's `hf_quant_config.json` as its
    quantization_config where config.json has none (what those exports ship)."""
    path = Path(model_dir) / "hf_quant_config.json"
    if raw.get("quantization_config") or not path.is_file():
        return raw
    quant = json.loads(path.read_text()).get("quantization") or {}
    return {**raw, "quantization_config": {"quant_method": "modelopt", **quant}}


def parse_quant_config(raw: dict[str, Any], requested: str | None) -> QuantConfig | None:
    """`raw` is the checkpoint's config.json; `requested` the --quantization value ("" = none)."""
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    method = quant_method_name(str(qc.get("quant_method", ""))) if qc else ""
    requested = quant_method_name(requested or "")
    if requested and requested not in ONLINE and requested not in CHECKPOINT_METHODS:
        raise UnsupportedQuantization(
            f"quantization {requested!r}: expected one of {', '.join(ONLINE)} (or none)"
        )
    if requested in CHECKPOINT_METHODS and requested not in ONLINE and requested != method:
        found = f"quant_method {method!r}" if qc else "no quantization_config (a 16-bit one)"
        raise UnsupportedQuantization(
            f"quantization {requested!r} does not match the checkpoint, which has {found}; "
            f"leave --quantization empty to load it as it says"
            + ("" if qc else ", or use fp8 to quantise it at load")
        )
    if not qc:
        if not requested:
            return None
        return QuantConfig("fp8_channel", None, True, ONLINE_IGNORE, "online")
    if method == "fp8":
        return _parse_fp8(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method == "modelopt":
        return _parse_modelopt(qc)
    raise UnsupportedQuantization(
        f"quant_method {method!r} is not supported; supported: {SUPPORTED}"
    )


def _block(value: Any, field: str) -> tuple[int, int]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not ok or any(v not in BLOCK_SIZES for v in value):
        raise UnsupportedQuantization(
            f"{field} {value!r} is not supported: expected [block_n, block_k] with each in "
            f"{list(BLOCK_SIZES)}"
        )
    return int(value[0]), int(value[1])


def _parse_fp8(qc: dict[str, Any]) -> QuantConfig:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantization(f"fp8 fmt {fmt!r} is not supported: expected e4m3")
    activations = qc.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise UnsupportedQuantization(
            f"fp8 activation_scheme {activations!r} is not supported: expected dynamic or static"
        )
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    static = activations == "static"
    block = qc.get("weight_block_size")
    if block is None:  # per-tensor weight scales (AutoFP8): loaded as per-channel ones
        return QuantConfig("fp8_channel", None, False, ignore, "fp8", static)
    block = _block(block, "fp8 weight_block_size")
    return QuantConfig("fp8_block", block, False, ignore, "fp8", static)


def _parse_modelopt(qc: dict[str, Any]) -> QuantConfig:
    """NVIDIA ModelOpt: FP8 (per-tensor e4m3 weights, static per-tensor `input_scale`s) or
    FP8_PER_CHANNEL_PER_TOKEN (per-channel weights, dynamic activations); `exclude_modules`
    (shell wildcards) kept unquantised."""
    algo = str(qc.get("quant_algo") or "").upper()
    if algo not in MODELOPT_ALGOS:
        raise UnsupportedQuantization(
            f"modelopt quant_algo {qc.get('quant_algo')!r} is not supported: expected "
            f"{' or '.join(MODELOPT_ALGOS)}"
        )
    ignore = tuple(qc.get("exclude_modules") or qc.get("ignore") or ())
    return QuantConfig("fp8_channel", None, False, ignore, "modelopt", algo == "FP8")


def _parse_compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise UnsupportedQuantization(
            f"compressed-tensors format {fmt!r} is not supported; supported: {SUPPORTED}"
        )
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedQuantization(
            f"compressed-tensors: {len(groups)} config_groups; exactly one FP8 group is supported"
        )
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    want = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    for key, value in want.items():
        if weights.get(key) != value:
            raise UnsupportedQuantization(
                f"compressed-tensors weights {key}={weights.get(key)!r} is not supported "
                f"(expected {value!r}); supported: {SUPPORTED}"
            )
    static = bool(acts) and not acts.get("dynamic") and acts.get("strategy") == "tensor"
    if (
        not acts
        or acts.get("num_bits") != 8
        or acts.get("type") != "float"
        or not (acts.get("dynamic") or static)
    ):
        raise UnsupportedQuantization(
            f"compressed-tensors input_activations {acts!r} are not supported: expected 8-bit "
            "float, dynamic (FP8_DYNAMIC / FP8_BLOCK schemes) or static per tensor (FP8)"
        )
    ignore = tuple(qc.get("ignore") or ())
    targets = groups[0].get("targets") or ["Linear"]
    if isinstance(targets, str):
        targets = [targets]
    strategy = weights.get("strategy")
    source = "compressed-tensors"
    if strategy in ("channel", "tensor"):
        return QuantConfig("fp8_channel", None, False, ignore, source, static, tuple(targets))
    if strategy == "block":
        block = _block(weights.get("block_structure"), "compressed-tensors block_structure")
        return QuantConfig("fp8_block", block, False, ignore, source, static, tuple(targets))
    raise UnsupportedQuantization(
        f"compressed-tensors weights strategy {strategy!r} is not supported: expected channel, "
        "tensor or block"
    )


def quant_for(quant: QuantConfig | None, *names: str) -> QuantConfig | None:
    """`quant.for_module(*names)`, or None for an unquantised model."""
    return quant.for_module(*names) if quant is not None else None
