"""Which checkpoint folder a model argument names: `appliance serve [MODEL]`, `LLM(model)`.

"" is the embedded default model; an existing folder is served as it is (a local folder always
wins over a Hub id of the same spelling); `ORG/NAME` is a Hugging Face Hub id, resolved to its
snapshot in the Hub cache (appliance/assets/hub.py). Every failure is one ModelNotFoundError
line that names the model and what was tried.
"""

from __future__ import annotations

from pathlib import Path

from appliance.assets import hub
from appliance.logging import get_logger

logger = get_logger(__name__)


class ModelNotFoundError(ValueError):
    """The model argument names no usable checkpoint; one line: the model and what was tried."""


def resolve_model_dir(model: str | None, revision: str = "", load_format: str = "auto") -> Path:
    """The checkpoint folder to load. `revision` (a Hub branch, tag or commit) applies to Hub ids
    only; with load_format "dummy" no weights are needed (nor fetched)."""
    weights = load_format != "dummy"
    if not model:
        from appliance.assets.default_model import ensure_default_model

        if revision:
            raise ModelNotFoundError(f"--revision {revision}: only a Hub model id has revisions")
        return ensure_default_model()
    local = Path(model).expanduser()
    if local.exists():
        if revision:
            logger.warning("revision %r ignored: %s is a local folder", revision, local)
        _check_folder(model, local, weights)
        _check_tokenizer(model, local)
        return local
    if not hub.looks_like_hub_id(model):
        raise ModelNotFoundError(
            f"model {model!r}: no such folder ({local.absolute()}), and not a Hub id (ORG/NAME)"
        )
    try:
        folder = hub.snapshot(model, revision, weights, tried=f"no folder {local.absolute()}; ")
    except hub.HubError as exc:
        raise ModelNotFoundError(str(exc)) from None
    _check_tokenizer(model, folder)
    return folder


# A checkpoint's tokenizer is one of these (transformers' fast / slow BPE / sentencepiece files).
# Without one, transformers would build an empty tokenizer that turns every text into no tokens.
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))


def _check_tokenizer(model: str, folder: Path) -> None:
    if not any(all((folder / name).is_file() for name in files) for files in TOKENIZER_FILES):
        wanted = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
        raise ModelNotFoundError(f"model {model!r}: no tokenizer in {folder} (expected {wanted})")


def _check_folder(model: str, folder: Path, weights: bool) -> None:
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"model {model!r}: not a checkpoint folder (no config.json)")
    if weights and not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"model {model!r}: no *.safetensors weights in {folder} "
            "(--load-format dummy serves random weights)"
        )
