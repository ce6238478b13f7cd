"""Frozen configuration dataclasses, one per role; CLI defaults come from here (appliance/cli.py).

Validation raises ValueError naming the field and the accepted values.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field, fields

# appliance_kernels.kv_cache.KV_CACHE_DTYPES holds the torch dtypes
# appliance.models.layers.quant checks them against the checkpoint
QUANTIZATION_FLAGS = ("", "fp8", "compressed-tensors", "modelopt")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8: fp8_e4m3 (vLLM's spelling of it)


def quant_method_name(value: str) -> str:
    """A quantization method as vLLM accepts it: any case, `_` for `-` (compressed_tensors)."""
    return value.strip().lower().replace("_", "-")


def _check(cond: bool, name: str, accepted: str) -> None:
    if not cond:
        raise ValueError(f"{name}: expected {accepted}")


LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class ModelConfig:
    model_dir: str = ""  # checkpoint folder (HF layout); "" = the embedded default model
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights from config.json)
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16
    max_model_len: int = 0  # context length; 0 = the checkpoint's (rope scaling included)
    seed: int = 0  # seed for dummy weights
    # "" (as the checkpoint says) | fp8 (a bf16 checkpoint's weights to fp8 at load; an fp8
    # checkpoint as it says) | compressed-tensors | modelopt (the checkpoint's own method, as vLLM
    # takes it)
    quantization: str = ""
    # what logprobs report (vLLM's --logprobs-mode): raw_* the model's logits before any edit
    # (penalties, bias, masks) or temperature; processed_* after every edit, the temperature and
    # top-k / top-p / min-p; *_logprobs their log-softmax, *_logits the values themselves
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantization", quant_method_name(self.quantization))
        _check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", ", ".join(LOGPROBS_MODES))
        _check(self.load_format in ("auto", "dummy"), "load_format", "auto or dummy")
        _check(
            self.quantization in QUANTIZATION_FLAGS,
            f"quantization {self.quantization!r}",
            "fp8, compressed-tensors, modelopt or empty (as the checkpoint says)",
        )
        _check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            "auto, float32, bfloat16 or float16",
        )
        # a context must hold a prompt token and a generated one
        _check(
            self.max_model_len == 0 or self.max_model_len >= 2,
            "max_model_len",
            "0 (the checkpoint's) or an integer >= 2",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests at most (request slots)
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunk + decodes)
    num_kv_slots: int = 0  # KV token slots; 0 = sized from memory by the worker
    max_waiting: int = 1024  # queue length before new requests get 429
    mtp_step: int = 0  # MTP draft tokens per step (0 = MTP off)
    mtp_mode: str = "eagle"  # eagle: one MTP layer reused per step; vanilla: one module per step
    # drafts are proposed from the first N token ids only (0 = the whole vocabulary): BPE ids are
    # roughly ordered by frequency, and the draft's LM head read shrinks with N
    mtp_draft_vocab: int = 0
    # MTP: a step with more decoding requests than this verifies no drafts (its decodes are plain
    # rows, still drafted for the steps after); 0 = auto: verify while the accept length pays for
    # the verify's cost measured at startup, up to the largest graphed verify batch (no limit
    # without graphs); max_num_seqs: every step verifies
    mtp_disable_batch_size: int = 0
    prefix_caching: bool = True  # reuse the KV and GDN state of cached prompt prefixes
    # hybrid models: also snapshot the GDN state every N prompt tokens (prefill chunks end there),
    # so a prompt sharing only a long head with a cached one still hits; 0 = only at prompt and
    # generation ends. Each snapshot costs one snapshot slot (the startup log states its size).
    snapshot_interval: int = 2048
    # fcfs: first come, first served; priority (vLLM's): requests' `priority` orders the queue,
    # lower first, and a preemption takes the highest value first
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _check(self.snapshot_interval >= 0, "snapshot_interval", "an integer >= 0 (0: off)")
        _check(
            self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "fcfs or priority"
        )
        _check(self.mtp_mode in ("vanilla", "eagle"), "mtp_mode", "vanilla or eagle")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "an integer >= 1")
        _check(self.num_kv_slots >= 0, "num_kv_slots", "an integer >= 0")
        _check(0 <= self.mtp_step <= 3, "mtp_step", "0 (off), 1, 2 or 3")
        _check(self.mtp_draft_vocab >= 0, "mtp_draft_vocab", "an integer >= 0 (0: all)")
        _check(
            self.mtp_disable_batch_size >= 0, "mtp_disable_batch_size", "an integer >= 0 (0: auto)"
        )


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # tensor-parallel ranks
    device: str = "auto"  # auto | cpu | cuda

    def __post_init__(self) -> None:
        _check(self.tp >= 1, "tp", "an integer >= 1")
        _check(self.device in ("auto", "cpu", "cuda"), "device", "auto, cpu or cuda")


@dataclass(frozen=True)
class CacheConfig:
    mem_fraction: float = 0.85  # share of free device memory (after weights/profile) for pools
    # vLLM's --gpu-memory-utilization (SGLang's --mem-fraction-static): the share of the device's
    # whole memory this appliance may fill, weights, activation peak, graphs, the ViT's
    # reservation and pools together (what else runs on the device is counted against it);
    # 0 = mem_fraction's rule. When set, mem_fraction is not used
    gpu_memory_utilization: float = 0.0
    # auto (the model dtype) | fp8_e4m3 (half the bytes per KV slot; "fp8" is read as fp8_e4m3)
    kv_cache_dtype: str = "auto"
    # prefix-cache GDN state snapshot slots (one request's conv + SSM state each); 0 = auto:
    # 4 x max_num_seqs, on a GPU at most snapshot_mem_fraction of the pool memory
    snapshot_slots: int = 0
    snapshot_mem_fraction: float = 0.2  # share of the pool memory the auto snapshot pool may use

    def __post_init__(self) -> None:
        _check(self.snapshot_slots >= 0, "snapshot_slots", "an integer >= 0 (0: auto)")
        _check(
            0.0 <= self.snapshot_mem_fraction < 1.0, "snapshot_mem_fraction", "a number in [0, 1)"
        )
        _check(0.0 < self.mem_fraction <= 1.0, "mem_fraction", "a number in (0, 1]")
        _check(
            0.0 <= self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            "a number in (0, 1] (0: the --mem-fraction rule)",
        )
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", "auto, fp8 or fp8_e4m3")
        if self.kv_cache_dtype == "fp8":
            object.__setattr__(self, "kv_cache_dtype", "fp8_e4m3")


@dataclass(frozen=True)
class KernelConfig:
    attention_backend: str = "auto"  # auto | triton | flashinfer | torch (GDN/fp8: env flags)

    def __post_init__(self) -> None:
        _check(
            self.attention_backend in ("auto", "triton", "flashinfer", "torch"),
            "attention_backend",
            "auto, triton, flashinfer or torch",
        )


@dataclass(frozen=True)
class GraphConfig:
    disable_cuda_graph: bool = False  # run every step eagerly (no CUDA graphs; CPU never uses them)
    cuda_graph_max_bs: int = 0  # largest decode batch run as a CUDA graph; 0 = max_num_seqs, <= 256
    # a step that is one request's prefill chunk of fewer rows than this runs as a CUDA graph
    # (buckets 32..512; 0 = never)
    cuda_graph_max_prefill_tokens: int = 512
    # MTP: accept drafts on the host after an eager verify instead of the fused device step
    # (also APPLIANCE_DISABLE_MTP_FUSED_GRAPH=1)
    disable_mtp_fused_graph: bool = False

    def __post_init__(self) -> None:
        _check(self.cuda_graph_max_bs >= 0, "cuda_graph_max_bs", "an integer >= 0")
        _check(
            self.cuda_graph_max_prefill_tokens >= 0,
            "cuda_graph_max_prefill_tokens",
            "an integer >= 0",
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)


def field_names(cls) -> list[str]:
    return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class VisualConfig:
    """Image input: the limits the API server enforces and the visual server's knobs. Nested in
    ServerConfig (the server validates images; the launcher hands the whole config to the visual
    server)."""

    vision: bool = True  # serve image input when the checkpoint has a vision tower (off: text only)
    max_image_bytes: int = 20 * 1024 * 1024  # encoded bytes per image (data: URI or download)
    max_image_pixels: int = 40_000_000  # width x height per decoded image (decompression bombs)
    max_images_per_request: int = 16  # images across every message of one request
    image_fetch_timeout_s: float = 10.0  # deadline of one http(s) image fetch, redirects included
    image_fetch_allowed_networks: str = ""  # comma-separated CIDRs fetched even if not public
    visual_reserved_mem_gb: float = -1.0  # device memory held for ViT activations; -1 = measure
    visual_max_batch_size: int = 8  # images per ViT forward (the worst case measured at startup)
    visual_cache_mb: int = 2048  # shared-memory embedding cache, LRU (pinned entries may exceed it)

    def __post_init__(self) -> None:
        _check(self.max_image_bytes >= 1, "max_image_bytes", "an integer >= 1")
        _check(self.max_image_pixels >= 1, "max_image_pixels", "an integer >= 1")
        _check(self.max_images_per_request >= 1, "max_images_per_request", "an integer >= 1")
        _check(self.image_fetch_timeout_s > 0, "image_fetch_timeout_s", "a number > 0")
        try:
            for cidr in self.allowed_networks:
                ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            _check(False, "image_fetch_allowed_networks", "comma-separated CIDRs (10.0.0.0/8,...)")
        _check(
            self.visual_reserved_mem_gb == -1.0 or self.visual_reserved_mem_gb >= 0,
            "visual_reserved_mem_gb",
            "-1 (measure) or a number >= 0",
        )
        _check(self.visual_max_batch_size >= 1, "visual_max_batch_size", "an integer >= 1")
        _check(self.visual_cache_mb >= 1, "visual_cache_mb", "an integer >= 1")

    @property
    def allowed_networks(self) -> tuple[str, ...]:
        """image_fetch_allowed_networks as a tuple of CIDR strings."""
        parts = (p.strip() for p in self.image_fetch_allowed_networks.split(","))
        return tuple(p for p in parts if p)


SPEC_METRICS_LEVELS = ("none", "summary", "detailed")  # --per-request-spec-decode-metrics
TEMPLATE_SWITCHES = ("enable_thinking", "thinking")  # chat template switches: booleans only


def _json_object(text: str) -> dict | None:
    """`text` read as a JSON object ({} for ""), None when it is not one."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def chat_template_defaults(config: ServerConfig) -> dict:
    """--default-chat-template-kwargs as a dict (checked by ServerConfig)."""
    return _json_object(config.default_chat_template_kwargs) or {}


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # HTTP bind address (0.0.0.0 to listen on every interface)
    port: int = 8000  # HTTP port
    served_model_name: str = ""  # model id in the API; "" = the model folder's name
    max_prompt_chars: int = 0  # prompt characters accepted before tokenizing; 0 = 8 x context
    max_n: int = 16  # largest `n` (choices per request) accepted
    reasoning: str = "auto"  # <think> to reasoning_content: auto (prompt opens <think>) | on | off
    access_log: bool = True  # one INFO line per HTTP request (method, path, status, latency, id)
    api_key: str = ""  # comma-separated API keys; "" = APPLIANCE_API_KEY; neither = no auth
    metrics_require_key: bool = False  # /metrics needs the API key too (Prometheus must send it)
    allowed_origins: str = ""  # comma-separated CORS origins ("*" = any); "" = CORS off
    max_request_bytes: int = 32 * 1024 * 1024  # HTTP body limit (413 past it); images come inline
    request_timeout: float = 0.0  # seconds a request may run before it is aborted (408); 0 = none
    # a chat request's own `chat_template` (or chat_template_kwargs.chat_template) is rendered;
    # off: refused with a 400 (a template is code the server runs: a loop can hold a CPU for hours)
    trust_request_chat_template: bool = False
    # the chat template every chat request is rendered with (vLLM's --chat-template): a Jinja file
    # or the template text itself; "" = the checkpoint's (appliance/chat_template.py)
    chat_template: str = ""
    # sampling defaults of unset request fields: auto = the model's generation_config.json, none
    # (or vllm) = OpenAI's, or a folder holding a generation_config.json
    generation_config: str = "auto"
    # /v1/responses kept in the server's memory for previous_response_id, GET and DELETE (LRU,
    # also at most 1 GiB of their JSON); 0 = none kept (previous_response_id is refused)
    responses_store: int = 0
    # vLLM's: chat, completions and responses answers of one choice carry a `metrics` object
    # (the request's queue time, TTFT, decode time, mean ITL, tokens/s; in a stream, on the usage
    # chunk); null for n > 1 or several prompts
    enable_per_request_metrics: bool = False
    # vLLM's: with MTP on, `metrics.speculative_decoding` (the request's accept length, rate and
    # histograms): none | summary | detailed (summary plus each verify step's drafted / accepted)
    per_request_spec_decode_metrics: str = "none"
    # vLLM's: streams end with the usage chunk even when stream_options.include_usage is unset
    enable_force_include_usage: bool = False
    # vLLM's and SGLang's: a JSON object of chat template arguments every chat request renders
    # with unless it sets them itself (e.g. {"enable_thinking": false}); "" = none
    default_chat_template_kwargs: str = ""
    # A frozen (hashable) default rather than a factory: cli.py still treats it as a nested section.
    visual: VisualConfig = VisualConfig()  # image input limits and the visual server

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", "an integer in [0, 65535]")
        _check(self.max_prompt_chars >= 0, "max_prompt_chars", "an integer >= 0")
        _check(self.max_n >= 1, "max_n", "an integer >= 1")
        _check(self.reasoning in ("auto", "on", "off"), "reasoning", "auto, on or off")
        _check(self.max_request_bytes >= 1024, "max_request_bytes", "an integer >= 1024")
        _check(self.request_timeout >= 0, "request_timeout", "a number >= 0 (0 = no limit)")
        keys = [part.strip() for part in self.api_key.split(",")]
        # ", " would leave no key: authentication off while the config block shows one
        _check(not self.api_key or any(keys), "api_key", "at least one key (comma-separated)")
        _check(bool(self.generation_config), "generation_config", "auto, none or a folder")
        _check(self.responses_store >= 0, "responses_store", "an integer >= 0 (0: off)")
        defaults = _json_object(self.default_chat_template_kwargs)
        _check(
            defaults is not None
            and all(isinstance(defaults[k], bool) for k in TEMPLATE_SWITCHES if k in defaults),
            "default_chat_template_kwargs",
            'a JSON object, e.g. {"enable_thinking": false} (switches true or false)',
        )
        _check(
            self.per_request_spec_decode_metrics in SPEC_METRICS_LEVELS,
            "per_request_spec_decode_metrics",
            "none, summary or detailed",
        )


@dataclass(frozen=True)
class LaunchConfig:
    transport: str = "ipc"  # ZMQ between roles: ipc (sockets in a temp dir) | tcp (loopback)
    runner: str = "appliance.engine.runner:ModelRunner"  # model runner class, module:Class
    drain_timeout_s: float = 30.0  # on SIGTERM, seconds open requests get to finish before abort
    fatal_grace_s: float = 1.0  # after a role dies, seconds to deliver errors before stopping

    def __post_init__(self) -> None:
        _check(self.transport in ("ipc", "tcp"), "transport", "ipc or tcp")
        _check(":" in self.runner, "runner", "module.path:ClassName")
        _check(self.drain_timeout_s >= 0, "drain_timeout_s", "a number >= 0")
        _check(self.fatal_grace_s >= 0, "fatal_grace_s", "a number >= 0")


@dataclass(frozen=True)
class ServeConfig:
    """Everything `appliance serve` needs: the engine plus the server and launcher roles."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
