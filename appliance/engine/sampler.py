"""The worker's sampler: penalties, logprobs, then temperature/min-p/top-k/top-p sampling through
`appliance_kernels.sampling`. Called by the model runner once per step on the rows that sample.

Choices, documented here once:
- Seeds: every request reaching the worker carries a seed. An unseeded request gets one drawn once,
  at admission, by `appliance.router.scheduler.Scheduler.add_request`; greedy rows may have none.
- Offsets: the caller passes, per row, the position of the token being sampled (the request's length
  before the token is appended). Noise is a function of (seed, offset, token id) only, so a request
  recomputed after preemption, or batched differently, samples the same tokens.
- Penalties: repetition (HF: seen = prompt + output tokens; positive logits divided, negative ones
  multiplied), then frequency and presence (OpenAI: over output tokens only; subtract
  frequency * count + presence * [count > 0]).
- Logit bias (OpenAI `logit_bias`): added to the penalised logits of the named token ids, on every
  row of the request; ids past the logits' vocabulary are ignored (the server refuses them).
- allowed_token_ids / min_tokens (vLLM's): with `allowed_token_ids` every other id is -inf (after
  the bias, before the grammar's mask); before `min_tokens` generated tokens the row's
  `min_tokens_ban` ids (eos, stop token ids) are -inf, last, unless nothing else is left to
  sample.
- Structured outputs: the grammar's token bitmask (engine/guided.py) sets forbidden tokens to -inf
  after penalties and bias.
- Bad words (vLLM's `bad_words`, as token sequences): a word's last token is -inf wherever the
  output (not the prompt) ends with the word's other tokens; a one-token word always. Applied
  after the grammar's mask, before the min_tokens ban, and, as that ban, not where it would leave
  nothing to sample.
- Thinking budget (vLLM's `thinking_token_budget`): once a row's history holds that many tokens
  after its last `<think>` and no `</think>` after it, `</think>` is the only token it can sample
  (applied last, over every other edit); the markers are found on the device, nothing is read
  back.
- Logprobs report what vLLM's --logprobs-mode says (engine/logprobs_mode.py): by default the
  model's own distribution, before the edits above and the temperature; processed_logprobs the
  distribution the token was drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from appliance.engine.logprobs_mode import reported
from appliance.engine.transfer import to_device
from appliance.messages import SamplingOptions
from appliance_kernels.sampling import SAMPLING_EPS, sample
from appliance_kernels.token_bitmask import apply_token_bitmask


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: list[float | None]  # per row: logprob of the sampled token; None = not requested
    top_logprobs: list[list[tuple[int, float]] | None]  # per row: top (id, logprob), best first


@dataclass
class SamplingTensors:
    """Per-row sampling knobs as [B] device tensors (the buffers a CUDA graph would read)."""

    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingOptions], device: torch.device) -> SamplingTensors:
        for row in rows:
            if row.seed is None and row.temperature > 0:
                raise ValueError("seed: every sampled row needs one (the router draws it)")

        def f32(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device)

        return cls(
            temperature=f32([r.temperature for r in rows]),
            top_k=to_device([r.top_k for r in rows], torch.long, device),
            top_p=f32([r.top_p for r in rows]),
            min_p=f32([r.min_p for r in rows]),
            seeds=to_device([r.seed or 0 for r in rows], torch.long, device),
        )


def needs_penalties(row: SamplingOptions) -> bool:
    return row.repetition_penalty != 1.0 or row.presence_penalty != 0 or row.frequency_penalty != 0


def needs_history(row: SamplingOptions) -> bool:
    """Whether sampling the row reads its token history: penalties, or a bad word of several
    tokens (its prefix is matched against the output)."""
    return (
        needs_penalties(row)
        or any(len(word) > 1 for word in row.bad_words)
        or row.thinking_budget >= 0
    )


def apply_penalties(
    logits: torch.Tensor,  # [B, V] fp32
    rows: Sequence[SamplingOptions],
    token_history: Sequence[torch.Tensor],  # per row: [L_i] prompt + output token ids
    prompt_lens: Sequence[int] | None,  # per row: how many of token_history are prompt
) -> torch.Tensor:
    """Returns penalised logits [B, V] (a new tensor if any row has penalties, else `logits`)."""
    picked = [i for i, row in enumerate(rows) if needs_penalties(row)]
    if not picked:
        return logits
    if prompt_lens is None and any(
        rows[i].presence_penalty or rows[i].frequency_penalty for i in picked
    ):
        raise ValueError("prompt_lens: needed for presence/frequency penalties")
    device, vocab = logits.device, logits.shape[-1]
    hist = [token_history[i].to(device=device, dtype=torch.long) for i in picked]
    padded = pad_sequence(hist, batch_first=True, padding_value=vocab)  # [R, L]; pad -> bin V
    if padded.shape[1] == 0:
        return logits
    positions = torch.arange(padded.shape[1], device=device)[None, :]
    plens = to_device([prompt_lens[i] if prompt_lens else 0 for i in picked], torch.long, device)
    out_ids = torch.where(positions >= plens[:, None], padded, vocab)  # [R, L]; prompt -> bin V
    ones = torch.ones_like(padded, dtype=torch.float32)
    seen = torch.zeros(len(picked), vocab + 1, device=device).scatter_add_(1, padded, ones)
    counts = torch.zeros(len(picked), vocab + 1, device=device).scatter_add_(1, out_ids, ones)
    seen, counts = seen[:, :vocab] > 0, counts[:, :vocab]  # [R, V]

    def col(name: str) -> torch.Tensor:
        values = [float(getattr(rows[i], name)) for i in picked]
        return to_device(values, torch.float32, device)[:, None]

    index = to_device(picked, torch.long, device)
    sub = logits[index].float()  # [R, V]
    rep = col("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - col("frequency_penalty") * counts - col("presence_penalty") * (counts > 0).float()
    out = logits.clone()
    out[index] = sub.to(out.dtype)
    return out


def apply_logit_bias(
    logits: torch.Tensor,  # [B, V] fp32
    rows: Sequence[SamplingOptions],
) -> torch.Tensor:
    """Returns biased logits [B, V] (a new tensor if any row has a bias, else `logits`)."""
    vocab = logits.shape[-1]
    row_ids, token_ids, biases = [], [], []
    for i, row in enumerate(rows):
        for token_id, bias in row.logit_bias.items():
            if 0 <= token_id < vocab:
                row_ids.append(i)
                token_ids.append(token_id)
                biases.append(bias)
    if not row_ids:
        return logits
    device = logits.device
    index = (to_device(row_ids, torch.long, device), to_device(token_ids, torch.long, device))
    out = logits.clone()
    out.index_put_(index, to_device(biases, torch.float32, device).to(out.dtype), accumulate=True)
    return out


def apply_allowed_ids(logits: torch.Tensor, rows: Sequence[SamplingOptions]) -> torch.Tensor:
    """Returns logits [B, V] where rows with allowed_token_ids keep only those (a new tensor if
    any row has them, else `logits`). Ids past the logits' vocabulary are ignored (the server
    and the offline LLM refuse them)."""
    allowing = [i for i, r in enumerate(rows) if r.allowed_token_ids]
    if not allowing:
        return logits
    vocab, device = logits.shape[-1], logits.device
    out = logits.clone()
    for i in allowing:
        keep = to_device([t for t in rows[i].allowed_token_ids if t < vocab], torch.long, device)
        row = torch.full_like(out[i], float("-inf"))
        row[keep] = out[i, keep]
        out[i] = row
    return out


def apply_min_tokens(
    logits: torch.Tensor,  # [B, V] fp32, every other mask applied
    rows: Sequence[SamplingOptions],
    offsets: torch.Tensor | Sequence[int],  # [B] position of the token being sampled
    prompt_lens: Sequence[int] | None,
) -> torch.Tensor:
    """Returns logits [B, V] with each row's min_tokens ban (-inf) while it has generated fewer
    than min_tokens tokens (a new tensor if any row bans, else `logits`). A ban that would leave
    a row nothing to sample (allowed_token_ids or a grammar that allows only eos now) yields:
    the row keeps its logits, on the device, without a sync."""
    banning = [i for i, r in enumerate(rows) if r.min_tokens and r.min_tokens_ban]
    if not banning:
        return logits
    if prompt_lens is None:
        raise ValueError("prompt_lens: needed for min_tokens")
    where = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    vocab, device = logits.shape[-1], logits.device
    active = [i for i in banning if where[i] - prompt_lens[i] < rows[i].min_tokens]
    if not active:
        return logits
    out = logits.clone()
    for i in active:
        ids = to_device([t for t in rows[i].min_tokens_ban if t < vocab], torch.long, device)
        banned = out[i].index_fill(0, ids, float("-inf"))
        out[i] = torch.where(banned.amax() > float("-inf"), banned, out[i])
    return out


def apply_bad_words(
    logits: torch.Tensor,  # [B, V] fp32, the other masks applied
    rows: Sequence[SamplingOptions],
    token_history: Sequence[torch.Tensor] | None,  # per row [L_i] prompt + output (+ drafts)
    prompt_lens: Sequence[int] | None,
) -> torch.Tensor:
    """Returns logits [B, V] with each row's bad words' last tokens at -inf where they would
    complete the word (a new tensor if any row has bad words, else `logits`). The prefixes are
    compared on the device (the history's length, and so which words can match, is known on the
    host); nothing is read back. A ban that would leave a row nothing to sample yields."""
    banning = [i for i, r in enumerate(rows) if r.bad_words]
    if not banning:
        return logits
    vocab, device = logits.shape[-1], logits.device
    out = logits.clone()
    for i in banning:
        words = [w for w in rows[i].bad_words if w[-1] < vocab]
        ban = torch.zeros(vocab, dtype=torch.int32, device=device)
        singles = [w[0] for w in words if len(w) == 1]
        if singles:
            ban[to_device(singles, torch.long, device)] = 1
        if token_history is not None and prompt_lens is not None:
            generated = len(token_history[i]) - prompt_lens[i]
            longer = [w for w in words if 1 < len(w) <= generated + 1]
            if longer:
                ban.index_add_(0, *_matches(longer, token_history[i].to(device)))
        banned = out[i].masked_fill(ban > 0, float("-inf"))
        out[i] = torch.where(banned.amax() > float("-inf"), banned, out[i])
    return out


def apply_thinking_budget(
    logits: torch.Tensor,  # [B, V] fp32, every other edit applied
    rows: Sequence[SamplingOptions],
    token_history: Sequence[torch.Tensor] | None,  # per row [L_i] prompt + output (+ drafts)
) -> torch.Tensor:
    """Returns logits [B, V] where each budgeted row that is reasoning (its last think_start after
    its last think_end) with at least thinking_budget tokens after that think_start can sample
    only think_end (a new tensor if any row has a budget, else `logits`). Decided on the device,
    all budgeted rows at once (a few launches whatever their number)."""
    budgeted = [i for i, r in enumerate(rows) if r.thinking_budget >= 0]
    if not budgeted:
        return logits
    if token_history is None:
        raise ValueError("token_history: needed for thinking_token_budget")
    device, vocab = logits.device, logits.shape[-1]
    histories = [token_history[i].to(device) for i in budgeted]
    padded = pad_sequence(histories, batch_first=True, padding_value=-1)  # [R, L]
    knobs = [[rows[i].think_start, rows[i].think_end, rows[i].thinking_budget] for i in budgeted]
    start, end, budget = to_device(knobs, torch.long, device).unbind(1)
    lengths = to_device([h.numel() for h in histories], torch.long, device)
    where = torch.arange(padded.shape[1], device=device)[None, :]
    last_start = torch.where(padded == start[:, None], where, -1).amax(1)
    last_end = torch.where(padded == end[:, None], where, -1).amax(1)
    force = (last_start > last_end) & (lengths - 1 - last_start >= budget)  # [R]
    forced = torch.full((len(budgeted), vocab), float("-inf"), device=device)
    forced.scatter_(1, end.clamp(max=vocab - 1)[:, None], 0.0)
    index = to_device(budgeted, torch.long, device)
    out = logits.clone()
    out[index] = torch.where(force[:, None], forced, out[index])
    return out


def _matches(words: list[list[int]], history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(last ids [M], 1 where the history ends with the word's prefix [M] int32) of words of 2+
    tokens; prefixes right-aligned against the history's tail."""
    width = max(len(w) for w in words) - 1
    device = history.device
    padded = [[-1] * (width + 1 - len(w)) + w[:-1] for w in words]
    prefixes = to_device(padded, torch.long, device)  # [M, width], -1: before the prefix
    tail = history[-width:].to(torch.long)[None, :]
    hit = ((prefixes == tail) | (prefixes < 0)).all(dim=1).to(torch.int32)
    return to_device([w[-1] for w in words], torch.long, device), hit


def gather_logprobs(
    raw: torch.Tensor,  # [B, V] the model's logits
    edited: torch.Tensor,  # [B, V] after the requests' edits (pre-temperature)
    token_ids: torch.Tensor,  # [B]
    rows: Sequence[SamplingOptions],
    mode: str = "raw_logprobs",  # ModelConfig.logprobs_mode (engine/logprobs_mode.py)
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    logprobs: list[float | None] = [None] * len(rows)
    tops: list[list[tuple[int, float]] | None] = [None] * len(rows)
    picked = [i for i, row in enumerate(rows) if row.logprobs is not None]
    if not picked:
        return logprobs, tops
    index = to_device(picked, torch.long, edited.device)
    tops_asked = [rows[i].logprobs for i in picked]
    values = reported(raw[index], edited[index], [rows[i] for i in picked], mode)
    packed = pack_logprobs(values, token_ids[index], tops_asked).tolist()
    for i, row in zip(picked, packed):
        logprobs[i], tops[i] = unpack_logprobs(row, rows[i].logprobs)
    return logprobs, tops


def needs_edits(row: SamplingOptions, generated: int) -> bool:
    """Whether sampling the row takes more than its knobs (temperature, top-k/p, min-p, seed) and a
    grammar mask: penalties, a logit bias, allowed ids, bad words, a min_tokens ban in force after
    `generated` output tokens, a thinking budget, or logprobs to report. Such rows of the fused
    MTP step are edited (and scored) between its forward and its sampling
    (appliance/engine/mtp_graphs.py)."""
    return (
        row.logprobs is not None
        or needs_penalties(row)
        or bool(row.logit_bias)
        or bool(row.allowed_token_ids)
        or bool(row.bad_words)
        or (generated < row.min_tokens and bool(row.min_tokens_ban))
        or row.thinking_budget >= 0
    )


def edit_logits(
    logits: torch.Tensor,  # [B, V] fp32
    rows: Sequence[SamplingOptions],
    token_history: Sequence[torch.Tensor] | None,  # per row [L_i]; needed by needs_history rows
    offsets: torch.Tensor | Sequence[int],  # [B] position of the token being sampled
    prompt_lens: Sequence[int] | None,  # per row; needed for presence/frequency, min_tokens and
    # bad words
    token_bitmask: torch.Tensor | None,  # [B, ceil(V / 32)] int32 grammar masks, on the device
) -> torch.Tensor:
    """Every edit of the logits before sampling, in the module docstring's order: penalties, bias,
    allowed ids, the grammar's mask, bad words, the min_tokens ban, the thinking budget. A new
    tensor if any applies, else `logits` (the grammar's mask is applied in place on CUDA). Nothing
    is read back to the host and nothing waits for the stream, so the fused MTP step calls it
    between its graphs."""
    if token_history is None and any(needs_history(r) for r in rows):
        raise ValueError("token_history: needed for penalties and bad words of several tokens")
    if token_history is not None:
        logits = apply_penalties(logits, rows, token_history, prompt_lens)
    logits = apply_logit_bias(logits, rows)
    logits = apply_allowed_ids(logits, rows)
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    logits = apply_bad_words(logits, rows, token_history, prompt_lens)
    logits = apply_min_tokens(logits, rows, offsets, prompt_lens)
    return apply_thinking_budget(logits, rows, token_history)


def pack_logprobs(lp: torch.Tensor, token_ids: torch.Tensor, tops: Sequence[int]) -> torch.Tensor:
    """[R, 1 + 2 * max(tops)] fp32 on lp's device: per row the logprob of token_ids[r], its tops[r]
    best logprobs, then their ids (exact in fp32: vocabularies are far below 2**24). Each row's
    list is a top-k with its own k, so which of several tied tokens it names (the floor's, past
    what can be sampled) does not depend on what else the step scores."""
    width = max(tops, default=0)
    out = torch.zeros(lp.shape[0], 1 + 2 * width, dtype=torch.float32, device=lp.device)
    out[:, 0] = lp.gather(1, token_ids.to(device=lp.device, dtype=torch.long)[:, None])[:, 0]
    for k in sorted(set(tops) - {0}):
        rows = to_device([r for r, top in enumerate(tops) if top == k], torch.long, lp.device)
        values, ids = lp[rows].topk(k, dim=-1)
        out[rows, 1 : 1 + k] = values
        out[rows, 1 + width : 1 + width + k] = ids.float()
    return out


def unpack_logprobs(row: list[float], top: int) -> tuple[float, list[tuple[int, float]]]:
    """One host row of pack_logprobs -> (logprob, the first `top` (id, logprob) pairs)."""
    width = (len(row) - 1) // 2
    pairs = zip(row[1 + width : 1 + width + top], row[1 : 1 + top], strict=True)
    return row[0], [(int(i), v) for i, v in pairs]


class Sampler:
    """Eager sampler for a batch of rows (one row per sampling request in the step); `mode`:
    what logprobs report (ModelConfig.logprobs_mode, engine/logprobs_mode.py)."""

    def __init__(self, mode: str = "raw_logprobs") -> None:
        self.mode = mode

    def sample(
        self,
        logits: torch.Tensor,  # [B, V]
        rows: Sequence[SamplingOptions],
        token_history: Sequence[torch.Tensor] | None,  # per row [L_i]; needed for penalties
        offsets: torch.Tensor | Sequence[int],  # [B] position of the token being sampled
        prompt_lens: Sequence[int] | None = None,  # per row; needed for presence/frequency
        token_bitmask: torch.Tensor | None = None,  # [B, ceil(V / 32)] int32 grammar masks
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits: expected [{len(rows)}, V], got {tuple(logits.shape)}")
        device = logits.device
        if token_bitmask is not None:
            if device.type == "cuda":  # pageable host memory would wait for the whole stream
                token_bitmask = token_bitmask.pin_memory()
            token_bitmask = token_bitmask.to(device, non_blocking=True)
        raw = logits.float()
        scored = any(r.logprobs is not None for r in rows)
        if token_bitmask is not None and scored and self.mode.startswith("raw"):
            raw = raw.clone()  # the grammar's mask is applied in place on CUDA
        logits = edit_logits(raw, rows, token_history, offsets, prompt_lens, token_bitmask)
        if all(r.temperature < SAMPLING_EPS for r in rows):
            # all greedy, known on the host: one argmax (the sampling kernel's one pass over a
            # 248k vocabulary is 4x slower than torch's argmax on the H200, docs/benchmarks.md)
            token_ids = logits.argmax(dim=-1)
        else:
            params = SamplingTensors.from_rows(rows, device)
            if not isinstance(offsets, torch.Tensor):
                offsets = to_device(list(offsets), torch.long, device)
            offsets = offsets.to(device=device, dtype=torch.long)
            token_ids = sample(  # Triton on CUDA, the torch reference elsewhere
                logits,
                params.temperature,
                params.top_k,
                params.top_p,
                params.min_p,
                params.seeds,
                offsets,
            )
        logprobs, tops = gather_logprobs(raw, logits, token_ids, rows, self.mode)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=tops)
