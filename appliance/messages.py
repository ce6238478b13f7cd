"""Every message that crosses a process boundary, as typed msgspec structs (msgpack on the wire).

Writers and readers are named per class. No pickle anywhere: `encode()` / `decode()` below are the
only serializers used on sockets. Bulk tensors never travel here (image embeddings go by shm
handle).
"""

from __future__ import annotations

import msgspec

# ---------------------------------------------------------------- router -> worker (the seam)


class Guide(msgspec.Struct, frozen=True):
    """A structured-output constraint (issue 18): the grammar every sampled token must keep
    satisfiable. Written by server (server/guides.py), read by worker (engine/guided.py)."""

    kind: str  # "json_schema" | "regex" | "grammar" (EBNF) | "structural_tag" (xgrammar JSON)
    spec: str  # the JSON schema, regex, EBNF grammar or structural tag, as text
    after_token: int = -1  # the grammar starts after this token is sampled (</think>); -1: at once


class SamplingOptions(msgspec.Struct, frozen=True):
    """Per-request sampling knobs the worker's sampler needs. Written by server, read by worker."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs to return (0 = only the sampled one)
    # score the prompt (completions echo + logprobs): top alternatives per prompt token; None = off
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before sampling (OpenAI)
    guide: Guide | None = None  # structured output: the sampled tokens must follow its grammar
    # vLLM's min_tokens: `min_tokens_ban` (eos unless ignore_eos, and the stop token ids; the
    # router fills it at admission) cannot be sampled before `min_tokens` tokens are generated
    min_tokens: int = 0
    min_tokens_ban: list[int] = []
    allowed_token_ids: list[int] = []  # vLLM's: sample only among these ids ([]: all)
    # vLLM's bad_words as token sequences: a sequence's last id is banned wherever the output
    # ends with the rest of it (a one-token word always)
    bad_words: list[list[int]] = []
    # vLLM's thinking_token_budget: once this many tokens follow the last `think_start` token
    # with no `think_end` after it, `think_end` is the only token sampled; -1 = no budget
    thinking_budget: int = -1
    think_start: int = -1  # the tokenizer's <think> and </think> ids (with a budget)
    think_end: int = -1


class ImageInput(msgspec.Struct, frozen=True):
    """One image of a request's prompt. Written by router (from the visual server's answer), read by
    worker, which fetches the embeddings by `handle` (appliance/engine/mm_inputs.py)."""

    offset: int  # index in token_ids of the image's first <|image_pad|> token
    num_tokens: int  # image tokens: t*h*w / merge_size**2
    grid_thw: tuple[int, int, int]  # ViT patch grid (t, h, w) before the spatial merge
    handle: str  # key of its embeddings [1 + deepstack, num_tokens, hidden] in the image store
    content_key: str = ""  # ImageData.key (content hash of the file + its grid): prefix-cache key


class NewRequest(msgspec.Struct, frozen=True):
    """A request the worker has not seen yet. Written by router, read by worker (once per admission;
    a preempted request is sent again with all its known tokens)."""

    req_slot: int  # row in req_to_token / token tables and linear-state pool
    token_ids: list[int]  # every known token (prompt + outputs when re-admitted after preemption)
    sampling: SamplingOptions
    num_prompt_tokens: int = -1  # leading prompt tokens in token_ids (-1: all); for penalties
    num_draft: int = 0  # MTP draft tokens per step for this request (0 = MTP off for it)
    mm: list[ImageInput] = []  # images in token_ids, sorted by offset (empty for text-only)
    # prefix-cache hit: KV slots of positions [0, len) already computed (shared with the router's
    # prefix tree); the first chunk starts at len. The linear-attention state of those positions
    # comes from snapshot slot `restore_snapshot` (-1: none, e.g. a model without GDN layers).
    cached_kv_slots: list[int] = []
    restore_snapshot: int = -1


class SnapshotSave(msgspec.Struct, frozen=True, array_like=True):
    """Copy a request slot's committed linear-attention state (GDN conv window + SSM state) into a
    snapshot slot of the prefix cache. Written by router, read by worker."""

    req_slot: int
    snapshot: int


class ScheduledChunk(msgspec.Struct, frozen=True):
    """Work for one request in one step. Written by router, read by worker.

    Computes positions [start, start + num_tokens) of the request. The token ids are already on the
    worker (NewRequest, or sampled by the worker itself in an earlier step)."""

    req_slot: int
    start: int  # first position computed in this step (= tokens already in the KV/state)
    num_tokens: int  # prefill chunk length, or 1 for a plain decode
    kv_slots: list[int]  # KV slot for each computed position, len == num_tokens
    sample: bool  # True when the chunk reaches the last known token: sample the next one
    # MTP verify: > 0 means rows = [last known token, num_draft worker-held drafts] at positions
    # start..start+num_draft (num_tokens == num_draft + 1). The worker returns the accepted tokens
    # (1..num_draft+1); KV slots of rows past the accepted ones go back to the router's pool.
    num_draft: int = 0
    # after this chunk's forward, save the request's linear-attention state (covering positions
    # [0, start + num_tokens)) into this prefix-cache snapshot slot (-1: none)
    save_snapshot: int = -1


PROFILE_ACTIVITIES = ("CPU", "GPU", "MEM")  # what ProfileAction.activities may name


class ProfileAction(msgspec.Struct, frozen=True):
    """Start or stop torch.profiler on every worker rank before the plan that carries it runs
    (POST /start_profile, /stop_profile; the offline LLM's start_profile / stop_profile). Written
    by server (inside a ProfileRequest), put in a StepPlan by router, read by worker
    (engine/profiler.py). Each rank writes `<output_dir>/<profile_id>-TP-<rank>.trace.json.gz`."""

    start: bool  # False: stop and write the traces
    output_dir: str = ""  # absolute; made by the server
    profile_id: str = ""  # the traces' file name stem
    # of CPU, GPU (CUDA kernels), MEM (allocations)
    activities: list[str] = msgspec.field(default_factory=lambda: ["CPU", "GPU"])
    record_shapes: bool = False
    with_stack: bool = False
    # > 0: the router sends the stop itself after this many device steps (0: at a stop request)
    num_steps: int = 0


class StepPlan(msgspec.Struct, frozen=True):
    """One forward step. Written by router, broadcast to every worker rank. The worker applies
    `released_slots` before `new_requests`: a slot can be freed and reused in the same plan."""

    step_id: int
    new_requests: list[NewRequest]
    chunks: list[ScheduledChunk]
    released_slots: list[int]  # req slots freed since the last step (finished, aborted, preempted)
    # states of requests that ended (their prefix goes into the prefix cache): applied first,
    # before `released_slots` frees their request slots
    snapshot_saves: list[SnapshotSave] = []
    profile: ProfileAction | None = None  # the profiler switch, applied before the step runs


class SampledTokens(msgspec.Struct, frozen=True):
    """Tokens one request gained in a step. Written by worker rank 0, read by router."""

    req_slot: int
    token_ids: list[int]
    logprobs: list[float] | None = None  # logprob of each sampled token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob) pairs


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Scores of a run of prompt tokens: each token's logprob under the model given the tokens
    before it (raw logits: no penalties, no bias), with the top alternatives. Written by worker
    rank 0 (the part a prefill chunk computed, in PromptScores), joined by router (the whole
    prompt, in the request's first TokenUpdate), read by detokenizer."""

    start: int  # prompt index of token_ids[0]
    token_ids: list[int]  # the scored prompt tokens
    logprobs: list[float | None]  # per token; None for prompt token 0 (nothing before it)
    top: list[list[tuple[int, float]]]  # per token: (id, logprob) pairs, best first
    # per token: its rank in the whole vocabulary, 1 + the ids with a strictly higher logprob (1 =
    # the most likely; vLLM's Logprob.rank, which may exceed len(top)); 0 for prompt token 0.
    # Empty from a writer that does not rank (read as "not known")
    ranks: list[int] = []


class PromptScores(msgspec.Struct, frozen=True):
    """The prompt tokens one chunk scored (SamplingOptions.prompt_logprobs). Written by worker
    rank 0, read by router."""

    req_slot: int
    scores: PromptLogprobs


class ProfileReport(msgspec.Struct, frozen=True):
    """What the profiler did with a plan's ProfileAction (on every rank: a switch that failed on
    one is undone or reported by all). Written by worker rank 0 (in StepResult), read by router."""

    ok: bool
    message: str
    started: bool = False  # True: the profiler runs from this step on; False: it stopped
    files: list[str] = []  # the traces written (every rank's, by the naming rule), at a stop


class StepResult(msgspec.Struct, frozen=True):
    """Result of one StepPlan. Written by worker rank 0, read by router."""

    step_id: int
    sampled: list[SampledTokens]
    forward_s: float = 0.0  # worker time spent in the step
    prompt_scores: list[PromptScores] = []  # prompt logprobs computed by the step's chunks
    # structured outputs: request slots whose grammar the worker compiled since its last result
    # (the router plans no sampling row of a guided request before it is listed here)
    guides_ready: list[int] = []
    profile: ProfileReport | None = None  # what the profiler did with the plan's action


_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _ENCODER.encode(msg)


def decoder(cls: type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(cls)


# ---------------------------------------------------------------- server -> router


class DetokParams(msgspec.Struct, frozen=True):
    """How one request's tokens become text. Written by server (inside TokenizedRequest), forwarded
    unchanged by router (DetokRegister), read by detokenizer."""

    stop: list[str] = []  # stop strings; the text ends before the first match
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text)
    skip_special_tokens: bool = True  # drop special tokens (<|im_end|>, ...) from the text
    logprobs: bool = False  # send per-token logprob entries with the text
    # vLLM's min_tokens: a stop string only ends the request where it ends in the text of a
    # token after the first min_tokens
    min_tokens: int = 0


class ImageData(msgspec.Struct, frozen=True, array_like=True):
    """One image of a request on its way to the visual server: the file the server fetched and
    checked. Written by server (in TokenizedRequest.images), read by visual."""

    # content hash of `data` and the grid it is resized to, the embedding-cache key (an identical
    # file at the same size is encoded once; at another request's pixel range it is another entry)
    key: str
    data: bytes  # the encoded file (PNG / JPEG / WebP / GIF) that the server's decoder accepted
    offset: int  # index in prompt_token_ids of the image's first <|image_pad|>
    grid_thw: tuple[int, int, int]  # ViT patch grid after smart resize to the pixel range below
    # the request's resize range (mm_processor_kwargs, checked by the server); 0: the checkpoint's
    # preprocessor_config.json bound. The visual server resizes to it and must reach grid_thw.
    min_pixels: int = 0
    max_pixels: int = 0


class RepetitionCheck(msgspec.Struct, frozen=True, array_like=True):
    """vLLM's repetition_detection: the request ends ("repetition") once its output ends with a
    pattern of min_size..max_size tokens repeated min_count times in a row. Written by server or
    offline LLM (in a TokenizedRequest), read by the router's Scheduler."""

    min_size: int
    max_size: int
    min_count: int

    def found(self, tokens: list[int]) -> bool:
        """Whether `tokens` end with such a repetition."""
        for size in range(self.min_size, self.max_size + 1):
            span = size * self.min_count
            if span > len(tokens):
                break
            if tokens[-span:] == tokens[-size:] * self.min_count:
                return True
        return False


class TokenizedRequest(msgspec.Struct, tag="tokenized", frozen=True):
    """A tokenized request (one choice: `n` > 1 arrives as n of these). Written by server, read by
    router — through the visual server when the model has a vision tower (it encodes `images`
    into `mm` and relays everything else unchanged)."""

    req_id: str  # unique id chosen by the server ("chatcmpl-…-0")
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    # generated tokens at most (the server has already capped it by the context); 0 = only score
    # the prompt (completions echo): the prefill's sample is dropped
    max_tokens: int
    ignore_eos: bool = False
    stop_token_ids: list[int] = []  # extra token ids that end the request (finish_reason "stop")
    detok: DetokParams = DetokParams()
    arrival_time: float = 0.0  # time.time() when the HTTP request arrived (queue-time metrics)
    images: list[ImageData] = []  # images to encode (server -> visual); empty once encoded
    mm: list[ImageInput] = []  # encoded images by cache handle, sorted by offset (visual -> router)
    # chat: where the generation prompt starts (its `<|im_start|>`), -1: none. The next turn's
    # re-rendered conversation (its past replies without their <think> block) first differs after
    # it, so on a hybrid model the router snapshots the state there (a prefix-cache point)
    turn_start: int = -1
    priority: int = 0  # lower is admitted first under --scheduling-policy priority (vLLM's)
    # its token updates carry RequestTiming (the server's --enable-per-request-metrics, for a
    # response of one choice)
    report_timing: bool = False
    repetition: RepetitionCheck | None = None  # vLLM's repetition_detection (None: off)
    # vLLM's cache_salt: the request shares cached prefixes only with requests of the same salt
    # (router/prefix_cache.py salted_key); "" = none
    cache_salt: str = ""
    # its token updates carry SpecCounts (SGLang's /generate meta_info, vLLM's per-request
    # speculative_decoding metrics); with MTP on only
    report_spec: bool = False


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    """Drop a request now and free its slots (client went away, drain timeout). Written by server,
    read by router."""

    req_id: str


class FinishRequest(msgspec.Struct, tag="finish", frozen=True):
    """The detokenizer matched a stop string: end the request and free its slots. Written by
    detokenizer, read by router."""

    req_id: str
    reason: str = "stop"


class RejectRequest(msgspec.Struct, tag="reject", frozen=True):
    """A request the visual server could not prepare (an image that fails preprocessing). Written by
    visual, read by router, which fails it like one of its own rejections (HTTP `status`)."""

    req_id: str
    message: str
    status: int = 400


class VisualStats(msgspec.Struct, tag="visual_stats", frozen=True):
    """The visual server's embedding cache and image timings. Written by visual (whenever its cache
    changed), read by server (metrics, /debug/status)."""

    cache_entries: int  # images held in the shared-memory cache
    cache_pinned: int  # entries pinned by live requests (never evicted)
    cache_bytes: int  # bytes of embeddings held
    cache_queries: int = 0  # cumulative images looked up
    cache_hits: int = 0  # cumulative images found already encoded (or being encoded)
    preprocess_s: list[float] = []  # new per-image decode + preprocessing times since the last one
    encode_s: list[float] = []  # new per-image ViT times (share of its batch) since the last one


class ReleaseImages(msgspec.Struct, tag="release_images", frozen=True):
    """Requests that ended (finished, aborted, rejected): unpin their cache entries. Written by
    router once no step that could still load their embeddings is in flight, read by visual."""

    req_ids: list[str]


class StatusQuery(msgspec.Struct, tag="status_query", frozen=True):
    """Ask for a router snapshot (/debug/status). Written by server, read by router (through the
    visual server when there is one); answered with a RouterStatus sent straight to the server."""

    query_id: int


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", frozen=True):
    """Empty the prefix cache (POST /reset_prefix_cache, /flush_cache). Written by server, read by
    router (through the visual server when there is one), which drops every entry no live request
    holds; answered with a PrefixCacheReset sent straight to the server."""

    query_id: int


class ProfileRequest(msgspec.Struct, tag="profile_request", frozen=True):
    """Start or stop the workers' profiler (POST /start_profile, /stop_profile). Written by
    server, read by router (through the visual server when there is one), which puts the action
    in its next plan (an empty one when idle); answered with a ProfileAnswer once rank 0 has
    applied it."""

    query_id: int
    action: ProfileAction


# ---------------------------------------------------------------- router -> detokenizer -> server


class DetokRegister(msgspec.Struct, frozen=True, array_like=True):
    """A request the detokenizer will receive tokens for. Written by router (when the request is
    admitted to the queue, always before its first TokenUpdate), read by detokenizer."""

    req_id: str
    prompt_len: int
    params: DetokParams


class SpecCounts(msgspec.Struct, frozen=True, array_like=True):
    """One request's MTP verify steps so far (cumulative), by draft length: what SGLang's
    /generate meta_info (spec_verify_ct, spec_accept_length ...) and vLLM's per-request
    `metrics.speculative_decoding` report. Written by the router's Scheduler, carried by
    TokenUpdate / TextDelta, read by the server."""

    # by_length[d - 1][a]: verify steps that drafted d tokens and accepted a of them (d = 1..k,
    # k = --mtp-step; a step near max_tokens drafts fewer than k)
    by_length: list[list[int]]

    @property
    def histogram(self) -> list[int]:
        """Verify steps by accepted drafts, 0..k (whatever each drafted)."""
        counts = [0] * (len(self.by_length) + 1)
        for row in self.by_length:
            for accepted, steps in enumerate(row):
                counts[accepted] += steps
        return counts

    @property
    def verify_steps(self) -> int:
        return sum(sum(row) for row in self.by_length)

    @property
    def draft_tokens(self) -> int:
        return sum(d * sum(row) for d, row in enumerate(self.by_length, 1))

    @property
    def accepted_tokens(self) -> int:
        return sum(a * steps for row in self.by_length for a, steps in enumerate(row))


class RequestTiming(msgspec.Struct, frozen=True, array_like=True):
    """One request's engine timing so far, in seconds, measured by the router's Scheduler (vLLM's
    per-request metrics): queued until first scheduled, scheduled until its first token, first
    until last token. Carried by TokenUpdate / TextDelta for requests that ask (report_timing)."""

    queue_s: float
    ttft_s: float  # 0 before the first token
    generation_s: float


class TokenUpdate(msgspec.Struct, frozen=True, array_like=True):
    """Tokens one request gained in a step, or its end. Written by router, read by detokenizer."""

    req_id: str
    token_ids: list[int]  # new tokens since the last update (may be empty on a pure finish)
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    logprobs: list[float] | None = None  # logprob of each new token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (id, logprob) pairs
    error: str | None = None  # message when finish_reason == "error" (e.g. request rejected)
    error_status: int = 0  # HTTP status for a rejection before any token (400, 429, 503)
    prompt_logprobs: PromptLogprobs | None = None  # the whole prompt's scores, in the first update
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (usage.cached_tokens)
    spec: SpecCounts | None = None  # its MTP counts so far; None before its first verify step
    timing: RequestTiming | None = None  # its timing so far, when the request reports it


class SchedulerStats(msgspec.Struct, frozen=True):
    """The scheduler's snapshot (counters cumulative since start). Written by the router's
    Scheduler (inside RouterStats), read by server (metrics, stats line) and the offline `LLM`."""

    num_running: int
    num_waiting: int
    kv_used: int  # KV token slots in use
    kv_total: int
    state_used: int  # request slots in use (= linear-attention state slots)
    state_total: int
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt positions computed, each counted once (recompute excluded)
    num_generation_tokens: int = 0  # sampled tokens accepted by update()
    num_computed_tokens: int = 0  # every position scheduled, recompute included
    num_finished: int = 0  # requests that ended for any reason (aborts included)
    num_steps: int = 0  # steps planned
    mtp_drafts: int = 0  # MTP verify steps
    mtp_draft_tokens: int = 0  # draft tokens proposed
    mtp_accepted_tokens: int = 0  # draft tokens accepted
    mtp_accepted_per_position: list[int] = []  # accepted count per draft position
    mtp_paused_steps: int = 0  # steps whose decodes verified no drafts (router/mtp_policy.py)
    prefix_cache_queries: int = 0  # prompt tokens of admitted requests (first admission)
    prefix_cache_hits: int = 0  # of those, tokens found in the prefix cache (not computed)
    prefix_cache_nodes: int = 0  # nodes of the prefix tree
    prefix_cache_tokens: int = 0  # positions (KV slots) the prefix tree holds
    snapshots_used: int = 0  # linear-state snapshot slots in use
    snapshots_total: int = 0

    @property
    def snapshot_usage(self) -> float:
        return self.snapshots_used / self.snapshots_total if self.snapshots_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.kv_total if self.kv_total else 0.0

    @property
    def state_usage(self) -> float:
        return self.state_used / self.state_total if self.state_total else 0.0

    @property
    def mtp_mean_accept_len(self) -> float:
        """Tokens per verify step, the bonus token included (1 + accepted / drafts)."""
        return 1.0 + self.mtp_accepted_tokens / self.mtp_drafts if self.mtp_drafts else 0.0


class RouterStats(msgspec.Struct, tag="router_stats", frozen=True):
    """The router's report for /metrics and the stats line: the scheduler's snapshot plus what the
    router loop itself measures. Written by router (at most every 0.5 s while busy, once when it
    goes idle, and inside every RouterStatus), read by server."""

    scheduler: SchedulerStats
    queue_time_s: list[float] = []  # queue times of requests first scheduled since the last one
    step_overhead_ms: float = 0.0  # mean router time per step: plan, send, update (recent)
    step_forward_ms: float = 0.0  # mean worker time per step, launch to result (recent)


class RequestProgress(msgspec.Struct, frozen=True, array_like=True):
    """One live request in a /debug/status snapshot (no prompt text). Written by router, read by
    server."""

    req_id: str
    status: str  # "waiting" | "running"
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    kv_slots: int
    preemptions: int
    cached_tokens: int = 0  # prompt tokens it found in the prefix cache


class RouterStatus(msgspec.Struct, tag="router_status", frozen=True):
    """Answer to a StatusQuery (/debug/status). Written by router, read by server."""

    query_id: int
    stats: RouterStats
    requests: list[RequestProgress] = []


class PrefixCacheReset(msgspec.Struct, tag="prefix_cache_reset", frozen=True):
    """Answer to a ResetPrefixCache: what the reset freed and what it had to keep. Written by
    router, read by server (the route's JSON body)."""

    query_id: int
    prefix_caching: bool  # False: caching is off (every count 0)
    freed_tokens: int = 0  # cached positions dropped (their KV slots freed)
    freed_snapshots: int = 0  # linear-state snapshot slots freed
    # entries on a live request's path (its cached prefix, locked): they stay, and become
    # evictable (or resettable) once the request ends
    kept_tokens: int = 0
    kept_snapshots: int = 0


class ProfileAnswer(msgspec.Struct, tag="profile_answer", frozen=True):
    """Answer to a ProfileRequest: rank 0's report, or why the router refused it (a start while
    profiling, a stop while not). Written by router, read by server (the route's JSON body)."""

    query_id: int
    ok: bool
    message: str
    files: list[str] = []


class RouterOutput(msgspec.Struct, tag="router_output", frozen=True):
    """One step's worth of updates. Written by router, read by detokenizer."""

    registers: list[DetokRegister] = []
    updates: list[TokenUpdate] = []


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One token's logprob entry in OpenAI form. Written by detokenizer, read by server."""

    token: str  # the token's text ("bytes:\\xe4" style is not used: invalid UTF-8 shows as U+FFFD)
    logprob: float | None  # None only for a prompt's first token (nothing before it scores it)
    bytes: list[int]  # the token's raw UTF-8 bytes
    top: list[tuple[str, float, list[int]]] = []  # (token, logprob, bytes), best first
    # the ids behind the texts, which the server needs for vLLM's shapes (prompt_logprobs dicts
    # keyed by id, return_tokens_as_token_ids); -1 / [] in an entry built without them
    token_id: int = -1
    top_ids: list[int] = []  # the id of each `top` entry, in its order
    rank: int = 0  # a prompt token's vocabulary rank (PromptLogprobs.ranks); 0: not known


class TextDelta(msgspec.Struct, frozen=True, array_like=True):
    """New text of one request. Written by detokenizer, read by server."""

    req_id: str
    text: str  # new text since the last delta (never a broken UTF-8 sequence)
    token_ids: list[int]  # tokens consumed since the last delta
    num_output_tokens: int  # tokens generated so far (usage.completion_tokens)
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None  # one entry per token of token_ids
    error: str | None = None
    error_status: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token, in the first delta
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (as in TokenUpdate)
    spec: SpecCounts | None = None  # the request's MTP counts so far (as in TokenUpdate)
    timing: RequestTiming | None = None  # its timing so far (as in TokenUpdate)


class DetokOutput(msgspec.Struct, tag="detok_output", frozen=True):
    """A batch of text deltas. Written by detokenizer, read by server."""

    deltas: list[TextDelta] = []
    # requests the detokenizer holds state for, after this batch (server: /debug/status); a batch
    # without deltas is sent when only this changed (an aborted request forgotten)
    num_live: int = 0


# ---------------------------------------------------------------- every role <-> launcher


class WorkerInfo(msgspec.Struct, frozen=True):
    """What the model worker learned at load time. Written by worker rank 0 (in ProcessReady),
    read by launcher, which hands it to router and server."""

    num_kv_slots: int
    max_model_len: int
    eos_token_ids: list[int]
    num_snapshot_slots: int = 0  # prefix-cache linear-state snapshot slots (0: none)
    linear_state: bool = False  # the model has GDN layers: a prefix hit must restore a snapshot
    # the largest batch of MTP verify requests the fused step holds as a CUDA graph (0: no graph:
    # CPU, --disable-cuda-graph, MTP off); the router's verify limit when no costs came
    mtp_verify_max_bs: int = 0
    # {verify batch: verify step time / (plain decode + draft pass) time}, measured on the
    # captured graphs at startup (empty without them); the router's MTP verify policy
    mtp_verify_costs: dict[int, float] = {}


class StartupProgress(msgspec.Struct, tag="progress", frozen=True):
    """A startup stage for the progress display. Written by any role, read by launcher."""

    role: str
    rank: int
    stage: str  # "loading model", "building tokenizer", ...


class VisualInfo(msgspec.Struct, frozen=True):
    """What the visual server measured at startup. Written by visual (in ProcessReady), read by
    launcher, which passes reserved_bytes to the worker that shares the ViT's device."""

    device: str  # the ViT's device ("cuda:0", "cpu")
    reserved_bytes: int  # device bytes held back from the KV/state pools for ViT activations
    peak_bytes: int  # measured activation peak of the worst case (-1 when overridden by a flag)
    worst_case_grid: tuple[int, int, int]  # per-image patch grid of the worst case
    batch_size: int  # images in the worst-case batch


class ProcessReady(msgspec.Struct, tag="ready", frozen=True):
    """A role finished starting. Written by every role, read by launcher."""

    role: str  # "server" | "router" | "detokenizer" | "worker" | "visual"
    rank: int  # worker TP rank; 0 for the other roles
    pid: int
    worker: WorkerInfo | None = None  # set by worker rank 0
    visual: VisualInfo | None = None  # set by the visual server
    port: int = 0  # set by the server: the HTTP port it listens on (--port 0: the one it got)


class Drained(msgspec.Struct, tag="drained", frozen=True):
    """The server finished draining after a Drain. Written by server, read by launcher."""

    aborted: int  # requests aborted because the drain timeout passed


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """The role is alive (not stopped, not hung outside Python). Written by a thread in every role
    once a second (ipc.RoleLink), read by launcher, which fails the appliance when a role misses
    APPLIANCE_HEARTBEAT_TIMEOUT seconds of them."""

    role: str  # as in ProcessReady
    rank: int  # worker TP rank; 0 for the other roles


class StartupFailed(msgspec.Struct, tag="failed", frozen=True):
    """A role could not start for a reason its user can act on (a checkpoint that does not fit the
    model, an unsupported option, too little memory): one line instead of a traceback. Written by
    ipc.run_role just before the role exits, read by launcher (and the offline WorkerGroup)."""

    role: str  # the launcher's name for the process: "server", "worker 1", ...
    reason: str  # "<exception type>: <its message>"


class EngineReady(msgspec.Struct, tag="engine_ready", frozen=True):
    """Every role is up: start admitting requests. Written by launcher, read by server."""

    max_model_len: int
    num_kv_slots: int


class Drain(msgspec.Struct, tag="drain", frozen=True):
    """Stop admitting, let open requests finish (up to timeout_s), then answer Drained. Written by
    launcher (on SIGTERM), read by server."""

    timeout_s: float


class Fatal(msgspec.Struct, tag="fatal", frozen=True):
    """A role died: fail every open request with this message, report unhealthy. Written by
    launcher, read by server."""

    role: str
    message: str


ToRouter = (
    TokenizedRequest
    | AbortRequest
    | FinishRequest
    | StatusQuery
    | ResetPrefixCache
    | RejectRequest
    | ProfileRequest
)
ToVisual = (
    TokenizedRequest
    | AbortRequest
    | StatusQuery
    | ResetPrefixCache
    | ReleaseImages
    | ProfileRequest
)
ToServer = DetokOutput | RouterStats | RouterStatus | PrefixCacheReset | VisualStats | ProfileAnswer
ToLauncher = StartupProgress | ProcessReady | Drained | Heartbeat | StartupFailed
ToServerControl = EngineReady | Drain | Fatal
