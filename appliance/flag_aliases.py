"""vLLM's and SGLang's spellings of launch settings, in one place for the command line (cli.py) and
the offline LLM's keywords (offline/options.py): aliases of our flags, hints for theirs that mean
something else here, and FOREIGN_FLAGS, their flags translated to ours, ignored (with a reason) or
refused. flag_translation.py applies the tables (and reads the flags that go together, as
--speculative-config's keys). Imports only the standard library."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.sampling_params import MAX_LOGPROBS

# vLLM / SGLang spellings of the same settings: accepted as aliases of this appliance's flags
FLAG_ALIASES = {
    "tp": ("--tensor-parallel-size", "--tp-size"),
    "disable_cuda_graph": ("--enforce-eager",),
    # SGLang's share of the device for weights and pools, read as vLLM's (which also counts the
    # activation peak in it: a little less for the pools than SGLang would give)
    "gpu_memory_utilization": ("--mem-fraction-static",),
}
# theirs that mean something else here: an unknown-flag error names the nearest of ours
FLAG_HINTS = {
    "--speculative-draft-model-path": "--mtp-step (drafts come from the checkpoint's own MTP "
    "head; no draft model is loaded)",
}

# vLLM's spellings of the checkpoint's own MTP head (all the same head: vLLM reads them as "mtp")
MTP_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")
# SGLang's algorithms that draft with the checkpoint's MTP head when no draft model is given
MTP_ALGORITHMS = ("NEXTN", "EAGLE", "MTP")
# vLLM / SGLang reasoning parsers of `<think>...</think>` (`-` read as `_`)
REASONING_PARSERS = ("qwen3", "qwen3_thinking", "deepseek_r1")
# tool-call formats parsers/qwen3_coder.py reads inside <tool_call>: Qwen3-coder XML
# (qwen3_coder, vLLM's qwen3_xml) and Qwen2.5 / Hermes JSON (hermes, SGLang's qwen25 / qwen)
TOOL_CALL_PARSERS = ("qwen3_coder", "qwen3_xml", "hermes", "qwen25", "qwen")


@dataclass(frozen=True)
class ForeignFlag:
    """One vLLM / SGLang flag (and the offline keyword of its first spelling: `--context-length`
    is `context_length=`)."""

    flags: tuple[str, ...]  # command-line spellings; the first names it in messages and docs
    origin: str  # whose flag: vLLM, SGLang or both
    why: str  # what it does here: --help, the docs row and, when ignored, the INFO line
    # value -> our settings {config field: value}; {} or None: ignored (an INFO line says why);
    # ValueError: refused (one error line)
    read: Callable[[Any], dict[str, Any]] | None = None
    refused: str = ""  # the values refused (--help and the docs row)
    # read together with the other flags of its group (flag_translation.GROUP_READERS)
    group: str = ""
    takes: str = "value"  # value (one argument) | switch (no argument) | bool (--x / --no-x)
    type: Callable[[str], Any] = str  # the command line's value type
    metavar: str = "VALUE"
    choices: tuple[str, ...] = ()
    offline: bool = True  # also an offline LLM keyword


def _reasoning_parser(parser: str) -> dict[str, Any]:
    if parser.lower().replace("-", "_") not in REASONING_PARSERS:
        raise ValueError(
            f"not supported: the reasoning split here reads <think>...</think> "
            f"({', '.join(REASONING_PARSERS)})"
        )
    return {"reasoning": "on"}


def _tool_call_parser(parser: str) -> dict[str, Any]:
    if parser.lower().replace("-", "_") not in TOOL_CALL_PARSERS:
        raise ValueError(
            "not supported: the tool-call parser here reads Qwen's <tool_call> blocks, XML or "
            f"JSON ({', '.join(TOOL_CALL_PARSERS)})"
        )
    return {}


def _gdn_state_dtype(dtype: str) -> dict[str, Any]:
    if dtype.lower() not in ("auto", "float32", "fp32"):
        raise ValueError("not supported: the Gated-DeltaNet state is kept in float32 (auto)")
    return {}


def _only(value: Any, accepted: tuple, what: str) -> dict[str, Any]:
    """{} (taken, changing nothing) for an accepted value; else ValueError naming `what`."""
    if value not in accepted:
        raise ValueError(f"not supported: {what} is not served here")
    return {}


_VLLM, _SGLANG, _BOTH = "vLLM", "SGLang", "vLLM, SGLang"
_NO_VIT_TP = "the ViT already runs whole (not split over the TP ranks) in its own process"
_NO_BODIES = "request bodies are never logged; --access-log gives one line per request"
_CHUNKED = "prefill is always chunked here (--max-num-batched-tokens tokens a step)"

# Each foreign flag: what it becomes here, or why it changes nothing, or why it is refused.
FOREIGN_FLAGS = (
    # --- translated to ours ---
    ForeignFlag(
        ("--model",),
        _VLLM,
        "the positional MODEL",
        lambda path: {"model_dir": path},
        metavar="MODEL",
        offline=False,  # LLM(model) takes it
    ),
    ForeignFlag(
        ("--model-path",),
        _SGLANG,
        "the positional MODEL",
        lambda path: {"model_dir": path},
        metavar="MODEL",
        offline=False,
    ),
    ForeignFlag(
        ("--speculative-config",),
        _VLLM,
        f'{{"method": "mtp", "num_speculative_tokens": k}}: --mtp-step k (method: any of '
        f"{', '.join(MTP_METHODS)}); disable_by_batch_size N: --mtp-disable-batch-size N",
        refused="other methods (ngram, eagle, a draft model), other keys",
        group="vllm_speculative",
        metavar="JSON",
    ),
    ForeignFlag(
        ("--speculative-config.method",),
        _VLLM,
        "the method key of --speculative-config, given alone",
        group="vllm_speculative",
    ),
    ForeignFlag(
        ("--speculative-config.num_speculative_tokens",),
        _VLLM,
        "the num_speculative_tokens key of --speculative-config, given alone",
        group="vllm_speculative",
        type=int,
        metavar="K",
    ),
    ForeignFlag(
        ("--speculative-algorithm", "--speculative-algo"),
        _SGLANG,
        f"{', '.join(MTP_ALGORITHMS)} (no draft model) with --speculative-num-steps N: "
        "--mtp-step N",
        refused="other algorithms, or no --speculative-num-steps",
        group="sglang_speculative",
        metavar="NAME",
    ),
    ForeignFlag(
        ("--speculative-num-steps",),
        _SGLANG,
        "--mtp-step (with --speculative-algorithm)",
        group="sglang_speculative",
        type=int,
        metavar="N",
    ),
    ForeignFlag(
        ("--speculative-eagle-topk",),
        _SGLANG,
        "1: MTP drafts one chain",
        refused="above 1 (a tree of drafts)",
        group="sglang_speculative",
        type=int,
        metavar="K",
    ),
    ForeignFlag(
        ("--speculative-num-draft-tokens",),
        _SGLANG,
        "--speculative-num-steps + 1 (a chain's drafts and one more token)",
        refused="any other number",
        group="sglang_speculative",
        type=int,
        metavar="N",
    ),
    ForeignFlag(
        ("--reasoning-parser",),
        _BOTH,
        f"{', '.join(REASONING_PARSERS)}: --reasoning on (<think>...</think> to "
        "reasoning_content, also where the model opens <think> itself)",
        _reasoning_parser,
        refused="other parsers",
        metavar="NAME",
    ),
    ForeignFlag(
        ("--enable-prefix-caching",),
        _VLLM,
        "--prefix-caching (--no-enable-prefix-caching: --no-prefix-caching)",
        lambda on: {"prefix_caching": bool(on)},
        takes="bool",
    ),
    ForeignFlag(
        ("--disable-radix-cache",),
        _SGLANG,
        "--no-prefix-caching",
        lambda on: {"prefix_caching": not on},
        takes="switch",
    ),
    ForeignFlag(
        ("--context-length",),
        _SGLANG,
        "--max-model-len",
        lambda n: {"max_model_len": n},
        type=int,
        metavar="N",
    ),
    ForeignFlag(
        ("--max-running-requests",),
        _SGLANG,
        "--max-num-seqs",
        lambda n: {"max_num_seqs": n},
        type=int,
        metavar="N",
    ),
    ForeignFlag(
        ("--chunked-prefill-size",),
        _SGLANG,
        "--max-num-batched-tokens (the tokens of a step: a prefill chunk plus decodes); -1 (no "
        "chunking) is ignored: prefill is always chunked here",
        lambda n: {"max_num_batched_tokens": n} if n > 0 else {},
        type=int,
        metavar="N",
    ),
    ForeignFlag(
        ("--enable-priority-scheduling",),
        _SGLANG,
        "--scheduling-policy priority (requests' priority orders the queue; /generate reads "
        "SGLang's, higher first)",
        lambda on: {"scheduling_policy": "priority"} if on else {},
        takes="switch",
    ),
    ForeignFlag(
        ("--language-model-only",),
        _VLLM,
        "--no-vision (text only, no visual server)",
        lambda on: {"vision": not on},
        takes="switch",
    ),
    ForeignFlag(
        ("--limit-mm-per-prompt",),
        _VLLM,
        '{"image": n}: --max-images-per-request n; image 0: --no-vision',
        refused="video or audio above 0 (no video or audio input here)",
        group="limit_mm",
        metavar="JSON",
    ),
    ForeignFlag(
        ("--limit-mm-per-prompt.image",),
        _VLLM,
        "the image key of --limit-mm-per-prompt, given alone",
        group="limit_mm",
        metavar="N",
    ),
    ForeignFlag(
        ("--limit-mm-per-prompt.video",),
        _VLLM,
        "the video key of --limit-mm-per-prompt, given alone",
        refused="above 0",
        group="limit_mm",
        metavar="N",
    ),
    # --- accepted, changing nothing here (an INFO line each) ---
    ForeignFlag(
        ("--tool-call-parser",),
        _BOTH,
        f"tool calls are always parsed when a request has tools ({', '.join(TOOL_CALL_PARSERS)} "
        "formats)",
        _tool_call_parser,
        refused="other parsers",
        metavar="NAME",
    ),
    ForeignFlag(
        ("--enable-auto-tool-choice",),
        _VLLM,
        "tool_choice auto is always served (the default when a request has tools)",
        takes="switch",
    ),
    ForeignFlag(("--enable-chunked-prefill",), _VLLM, _CHUNKED, takes="bool"),
    ForeignFlag(
        ("--async-scheduling",),
        _VLLM,
        "always on: the router plans the next step while the current one runs",
        takes="bool",
    ),
    ForeignFlag(
        ("--trust-remote-code",),
        _BOTH,
        "no remote code runs: the model classes are built in",
        takes="switch",
    ),
    ForeignFlag(
        ("--enable-metrics",),
        _SGLANG,
        "/metrics (Prometheus) is always served",
        takes="switch",
    ),
    ForeignFlag(("--mm-enable-dp-encoder",), _SGLANG, _NO_VIT_TP, takes="switch"),
    ForeignFlag(
        ("--mm-encoder-tp-mode",), _VLLM, _NO_VIT_TP, choices=("weights", "data"), metavar="MODE"
    ),
    ForeignFlag(
        ("--mm-processor-cache-type",),
        _VLLM,
        "the visual server caches image embeddings in shared memory (--visual-cache-mb)",
        choices=("lru", "shm"),
        metavar="TYPE",
    ),
    ForeignFlag(
        ("--swap-space",),
        _VLLM,
        "no CPU swap: a preempted request is recomputed from its tokens when re-admitted",
        type=float,
        metavar="GIB",
    ),
    ForeignFlag(("--enable-log-requests",), _VLLM, _NO_BODIES, takes="bool"),
    ForeignFlag(("--disable-log-requests",), _VLLM, _NO_BODIES, takes="switch"),
    ForeignFlag(("--log-requests",), _SGLANG, _NO_BODIES, takes="switch"),
    ForeignFlag(
        ("--disable-log-stats",),
        _VLLM,
        "the periodic stats line is set by APPLIANCE_LOG_STATS_INTERVAL (0 = off)",
        takes="switch",
    ),
    ForeignFlag(
        ("--enable-prompt-tokens-details",),
        _VLLM,
        "usage.prompt_tokens_details.cached_tokens is always reported",
        takes="switch",
    ),
    ForeignFlag(
        ("--enable-request-id-headers",),
        _VLLM,
        "every answer carries X-Request-Id (the client's, or a new one)",
        takes="switch",
    ),
    ForeignFlag(("--enable-log-outputs",), _VLLM, _NO_BODIES, takes="switch"),
    ForeignFlag(
        ("--enable-expert-parallel",),
        _VLLM,
        "every tensor-parallel rank holds its share of every expert (no expert parallelism)",
        takes="switch",
    ),
    ForeignFlag(
        ("--mamba-ssm-cache-dtype",),
        _VLLM,
        "the Gated-DeltaNet recurrent state is always kept in float32",
        _gdn_state_dtype,
        refused="bfloat16, float16 (the state would drift)",
        metavar="DTYPE",
    ),
    ForeignFlag(
        ("--mamba-cache-dtype",),
        _VLLM,
        "auto: the GDN conv window in the model's dtype, its recurrent state in float32",
        lambda value: _only(value, ("auto",), "--mamba-cache-dtype"),
        refused="anything but auto",
        metavar="DTYPE",
    ),
    ForeignFlag(
        ("--compilation-config", "-O"),
        _VLLM,
        "the engine captures its own CUDA graphs (decode, prefill and MTP steps); no torch.compile",
        metavar="JSON",
    ),
    ForeignFlag(
        ("--block-size",),
        _VLLM,
        "KV slots are allocated one token at a time (no blocks)",
        type=int,
        metavar="N",
    ),
    ForeignFlag(
        ("--max-logprobs",),
        _VLLM,
        f"up to {MAX_LOGPROBS} logprobs a token are served (more is a 400 naming the field)",
        type=int,
        metavar="N",
    ),
    ForeignFlag(
        ("--guided-decoding-backend", "--structured-outputs-config.backend"),
        _VLLM,
        "structured outputs always compile with xgrammar",
        metavar="NAME",
    ),
    ForeignFlag(
        ("--chat-template-content-format",),
        _VLLM,
        "message content is read as strings or OpenAI parts, whichever it is",
        choices=("auto", "string", "openai"),
        metavar="FORMAT",
    ),
    ForeignFlag(
        ("--root-path",),
        _VLLM,
        "routes are served at /; a reverse proxy that strips its prefix serves them below it",
        metavar="PATH",
    ),
    ForeignFlag(
        ("--data-parallel-size", "--dp-size"),
        _BOTH,
        "1: one engine per appliance (run several behind a load balancer for more)",
        lambda n: _only(n, (1,), "data parallelism"),
        refused="above 1",
        type=int,
        metavar="N",
    ),
    ForeignFlag(
        ("--pipeline-parallel-size", "--pp-size"),
        _BOTH,
        "1: the layers are not split over GPUs (--tp splits each layer)",
        lambda n: _only(n, (1,), "pipeline parallelism"),
        refused="above 1",
        type=int,
        metavar="N",
    ),
    ForeignFlag(
        ("--cpu-offload-gb",),
        _VLLM,
        "0: the weights stay on the GPU",
        lambda n: _only(n, (0.0,), "CPU offload"),
        refused="above 0",
        type=float,
        metavar="GIB",
    ),
    ForeignFlag(
        ("--ssl-keyfile", "--ssl-certfile"),
        _BOTH,
        "TLS is a reverse proxy's job here (docs/operations.md section 6)",
        lambda path: _only(path, (), "TLS"),
        refused="any file: serve TLS from a reverse proxy in front",
        metavar="FILE",
    ),
    ForeignFlag(
        ("--log-level",),
        _SGLANG,
        "the log level is APPLIANCE_LOG_LEVEL, read by every process",
        metavar="LEVEL",
    ),
    ForeignFlag(
        ("--uvicorn-log-level",),
        _VLLM,
        "uvicorn logs warnings and errors only; --access-log gives one line per request",
        metavar="LEVEL",
    ),
)
