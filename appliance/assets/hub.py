"""Hugging Face Hub model ids (`ORG/NAME`): the snapshot folder in the local Hub cache, fetched
first when the cache lacks it. Called by `resolve_model_dir` (appliance/assets/resolve.py).

huggingface_hub reads its own environment, the appliance none of it: HF_HOME / HF_HUB_CACHE (the
cache folder), HF_TOKEN (private and gated models), HF_HUB_OFFLINE=1 (the cache only, no network).
Only the files serving reads are fetched (`allow_patterns`); no weights for `--load-format dummy`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from appliance.logging import get_logger
from appliance.progress import Progress

logger = get_logger(__name__)

# What the appliance reads from a checkpoint folder: model and generation config (and a ModelOpt
# export's quantization config), tokenizer (fast tokenizer or its sources), chat template,
# image/video preprocessing.
SERVING_FILES = (
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class HubError(ValueError):
    """The Hub id could not be resolved; the message says what was tried, in one line."""


def looks_like_hub_id(text: str) -> bool:
    """`ORG/NAME` as the Hub spells repository ids (no leading `/`, `.` or `~`, one slash)."""
    return bool(_HUB_ID.fullmatch(text)) and ".." not in text


def cache_dir() -> str:
    """The Hub cache folder huggingface_hub uses (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def is_offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def snapshot(repo_id: str, revision: str = "", weights: bool = True, tried: str = "") -> Path:
    """The snapshot folder of `repo_id` at `revision` ("" = main) holding the serving files (and
    the safetensors weights when `weights`). Raises HubError; `tried` (what the caller checked
    before, e.g. the local folder) opens its message."""
    from huggingface_hub import snapshot_download

    offline = is_offline()
    where = f"{repo_id!r} (revision {revision or 'main'})"
    patterns = list(SERVING_FILES) + (list(WEIGHT_FILES) if weights else [])
    stderr_tty = _isatty()
    if not offline:
        logger.info("resolving %s on the Hub (cache %s)", where, cache_dir())
        if not stderr_tty:  # huggingface_hub's own bars are for terminals; a log gets our lines
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
    try:
        with Progress(f"fetching {repo_id} from the Hub", enabled=not offline and not stderr_tty):
            path = Path(
                snapshot_download(
                    repo_id,
                    revision=revision or None,
                    allow_patterns=patterns,
                    local_files_only=offline,
                )
            )
    except Exception as exc:  # every huggingface_hub failure becomes one line naming the id
        reason = _reason(exc, repo_id, revision, offline)
        if reason is None:
            raise
        raise HubError(f"model {where}: {tried}{reason}") from None
    _check_snapshot(path, where, weights, offline)
    return path


def _reason(exc: Exception, repo_id: str, revision: str, offline: bool) -> str | None:
    """What went wrong, for the errors huggingface_hub raises; None for anything else."""
    from huggingface_hub import errors

    cache = f"the Hub cache {cache_dir()}"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"the Hub has {repo_id} but no revision {revision!r}"
    if isinstance(exc, errors.GatedRepoError):
        return f"{repo_id} is gated: accept its terms on the Hub, then set HF_TOKEN"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return f"not in {cache}, and the Hub has no such repository (private? set HF_TOKEN)"
    if isinstance(exc, getattr(errors, "IncompleteSnapshotError", ())):  # huggingface_hub >= 2
        return f"its snapshot in {cache} is incomplete and the Hub was not reached"
    if isinstance(exc, errors.LocalEntryNotFoundError):
        if offline:
            return f"not in {cache}, and HF_HUB_OFFLINE=1 forbids downloading it"
        return f"not in {cache}, and the Hub could not be reached"
    if isinstance(exc, errors.HFValidationError):
        return f"not a valid Hub id ({_first_line(exc)})"
    if isinstance(exc, errors.HfHubHTTPError):
        return f"the Hub refused it ({_first_line(exc)})"
    return None


def _check_snapshot(path: Path, where: str, weights: bool, offline: bool) -> None:
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    if weights and not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        hint = " (offline: nothing could be downloaded)" if offline else ""
        absent = " and no ".join(missing)
        raise HubError(f"model {where}: the snapshot {path} has no {absent}{hint}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
