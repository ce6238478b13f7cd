"""The model runner: owns the model, the pools and the sampler on one TP rank, and executes
StepPlans.

Called by the worker process loop (appliance/engine/worker.py) and by the offline `LLM`. Every rank
executes every plan; sampling is deterministic (seeded per request), so rank 0's result is the
result.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from appliance.config import EngineConfig
from appliance.engine.batch import StepBatch, build_batch
from appliance.engine.context import forward_context
from appliance.engine.mm_inputs import MultimodalInputs, SharedMemoryImageStore
from appliance.engine.mtp import Drafter, ExtendRows, accept, commit_gdn
from appliance.engine.pools import Pools, PoolSizes, kv_bytes_per_slot, state_bytes_per_slot
from appliance.engine.sampler import Sampler
from appliance.logging import get_logger
from appliance.messages import (
    SampledTokens,
    SamplingOptions,
    ScheduledChunk,
    StepPlan,
    StepResult,
)
from appliance.models.config import TextConfig, load_text_config
from appliance.models.layers.parallel import set_tp
from appliance.models.loader import init_dummy_weights, iter_tensors, load_weights
from appliance.models.registry import draft_factory, model_class
from kernels import backends

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_SLOTS = 32768


def resolve_model_dir(model_dir: str) -> Path:
    if model_dir:
        return Path(model_dir)
    from appliance.assets.default_model import ensure_default_model

    return ensure_default_model()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        world_size: int = 1,
        tp_group=None,
        reserved_bytes: int = 0,
    ) -> None:
        self.config = config
        self.reserved_bytes = reserved_bytes  # device memory held for the ViT (visual server)
        self.rank = rank
        set_tp(rank, world_size, tp_group)
        self.model_dir = resolve_model_dir(config.model.model_dir)
        self.text_config: TextConfig = load_text_config(self.model_dir)
        self.device = resolve_device(config.parallel.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        dtype = config.model.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = _DTYPES[dtype]
        self.backends = backends.configure(attention=config.kernels.attention_backend)
        self.model = self._build_model()
        self.max_model_len = config.model.max_model_len or self.text_config.max_position_embeddings
        self.eos_token_ids = self._eos_ids()
        self.mtp_step = config.scheduler.mtp_step
        self.draft_modules = self._build_drafts() if self.mtp_step else []
        self.pools = Pools(
            [self.model, *self.draft_modules], self._pool_sizes(), self.dtype, self.device
        )
        self.num_kv_slots = self.pools.sizes.num_kv_slots
        self.drafter = (
            Drafter(self.model, self.draft_modules, self.mtp_step, self.pools, self.device)
            if self.mtp_step
            else None
        )
        self.mtp_slots: set[int] = set()
        self.sampler = Sampler()
        self.options: dict[int, SamplingOptions] = {}
        self.prompt_lens: dict[int, int] = {}
        self.num_tokens: dict[int, int] = {}  # req_slot -> tokens known to this worker
        # image inputs (M-RoPE layout, embeddings to splice); tests may swap `self.mm.store`
        self.mm = MultimodalInputs(
            self.text_config,
            getattr(self.model, "num_deepstack", 0),
            SharedMemoryImageStore(),
            self.device,
            self.dtype,
        )

    # ------------------------------------------------------------------ startup
    def _build_model(self) -> torch.nn.Module:
        cfg = self.text_config
        cls = model_class(cfg)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(cfg)
        finally:
            torch.set_default_dtype(prev)
        start = time.perf_counter()
        if self.config.model.load_format == "dummy":
            init_dummy_weights(model, self.config.model.seed)
        else:
            tied = (
                {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_word_embeddings else {}
            )
            load_weights(model, iter_tensors(self.model_dir), tied)
        log.info(
            "loaded %s (%s) in %.2fs on %s",
            cfg.architecture,
            self.dtype,
            time.perf_counter() - start,
            self.device,
        )
        return model.eval()

    def _build_drafts(self) -> list[torch.nn.Module]:
        sched = self.config.scheduler
        build = draft_factory(self.text_config, sched.mtp_mode)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                modules = build(self.text_config, self.model, sched.mtp_mode, self.mtp_step)
        finally:
            torch.set_default_dtype(prev)
        for module in modules:
            if self.config.model.load_format == "dummy":
                init_dummy_weights(module, self.config.model.seed + 1)
            else:
                load_weights(module, iter_tensors(self.model_dir, prefix="mtp."))
            module.eval()
        log.info(
            "MTP: %s mode, %d draft step(s), %d draft module(s)",
            sched.mtp_mode,
            self.mtp_step,
            len(modules),
        )
        return modules

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.text_config.eos_token_ids)
        gen = self.model_dir / "generation_config.json"
        if gen.exists():
            import json

            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return tuple(sorted(ids))

    def _pool_sizes(self) -> PoolSizes:
        sched = self.config.scheduler
        slots = sched.num_kv_slots
        if not slots and self.device.type == "cuda":
            slots = self._slots_from_memory()
        elif not slots:
            slots = min(CPU_DEFAULT_KV_SLOTS, sched.max_num_seqs * self.max_model_len)
        return PoolSizes(slots, sched.max_num_seqs, self.max_model_len, self.mtp_step)

    @torch.inference_mode()
    def _profile_activation_bytes(self) -> int:
        """Peak memory of a worst-case step (one prefill of the whole token budget) above the
        weights, measured on throwaway pools."""
        tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        probe = Pools(
            [self.model, *self.draft_modules],
            PoolSizes(tokens, 1, tokens, self.mtp_step),
            self.dtype,
            self.device,
        )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        probe.token_ids[0, :tokens] = 0
        chunk = ScheduledChunk(0, 0, tokens, list(range(tokens)), True)
        batch = build_batch([chunk], probe, self.device)
        with forward_context(batch.ctx):
            hidden = self.model(batch.input_ids, batch.positions)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del probe, batch, hidden
        torch.cuda.empty_cache()
        return peak

    def _slots_from_memory(self) -> int:
        """Startup order: weights (loaded) -> worst-case profile forward -> hold back the ViT
        reservation -> `mem_fraction` of the rest, less the state pools, becomes the KV pool."""
        sched = self.config.scheduler
        activation = self._profile_activation_bytes()
        free, _ = torch.cuda.mem_get_info(self.device)
        state = state_bytes_per_slot(self.model, self.dtype, self.mtp_step) * sched.max_num_seqs
        per_slot = max(
            1, sum(kv_bytes_per_slot(m, self.dtype) for m in [self.model, *self.draft_modules])
        )
        budget = (free - activation - self.reserved_bytes) * self.config.cache.mem_fraction - state
        slots = int(budget // per_slot) - sched.max_num_seqs * self.mtp_step  # scratch slots
        log.info(
            "memory: %.2f GiB free after weights, %.2f GiB activation peak, %.2f GiB reserved "
            "for the ViT, %.2f GiB state pools -> %d KV slots",
            free / 2**30,
            activation / 2**30,
            self.reserved_bytes / 2**30,
            state / 2**30,
            slots,
        )
        if slots < sched.max_num_batched_tokens:
            raise RuntimeError(
                f"not enough device memory for the KV pool: {slots} slots fit, "
                f"fewer than max_num_batched_tokens={sched.max_num_batched_tokens}"
            )
        return slots

    # ------------------------------------------------------------------ steps
    def _admit(self, plan: StepPlan) -> None:
        for slot in plan.released_slots:
            self.options.pop(slot, None)
            self.num_tokens.pop(slot, None)
            self.prompt_lens.pop(slot, None)
            self.mtp_slots.discard(slot)
            self.mm.release(slot)
        for req in plan.new_requests:
            self.mm.admit(req)
            n = len(req.token_ids)
            self.pools.token_ids[req.req_slot, :n] = torch.tensor(req.token_ids)
            self.num_tokens[req.req_slot] = n
            self.options[req.req_slot] = req.sampling
            self.prompt_lens[req.req_slot] = (
                req.num_prompt_tokens if req.num_prompt_tokens >= 0 else n
            )
            if req.num_draft:
                if self.drafter is None:
                    raise ValueError(f"slot {req.req_slot}: MTP requested but the worker has none")
                self.mtp_slots.add(req.req_slot)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        self._admit(plan)
        if not plan.chunks:
            return StepResult(plan.step_id, [], 0.0)
        batch: StepBatch = build_batch(plan.chunks, self.pools, self.device)
        hidden = self.forward_batch(batch)
        sampled: list[SampledTokens] = []
        accepted: dict[int, int] = {}  # req slot -> rows committed this step (verify chunks)
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            sampled = self._sample(logits, batch, accepted)
        if self.drafter is not None:
            self.drafter.run(hidden, self._extend_rows(batch, accepted))
        return StepResult(plan.step_id, sampled, time.perf_counter() - start)

    def forward_batch(self, batch: StepBatch) -> torch.Tensor:
        """Post-final-norm hidden states [T, H] of a batch; requests with images get M-RoPE
        positions [3, T], their image embeddings spliced in and (Qwen3-VL) deepstack rows."""
        if not self.mm.involved(batch):
            with forward_context(batch.ctx):
                return self.model(batch.input_ids, batch.positions)
        step = self.mm.step_inputs(batch, self.model.model.embed_tokens)
        batch.ctx.deepstack = step.deepstack
        with forward_context(batch.ctx):
            return self.model(batch.input_ids, step.positions, step.input_embeds)

    def _sample(
        self, logits: torch.Tensor, batch: StepBatch, accepted: dict[int, int]
    ) -> list[SampledTokens]:
        chunks = [c for c in batch.chunks if c.sample]
        rows, histories, offsets, prompt_lens = [], [], [], []
        for chunk in chunks:
            known = chunk.start + 1 if chunk.num_draft else self.num_tokens[chunk.req_slot]
            for j in range(chunk.num_draft + 1):
                rows.append(self.options[chunk.req_slot])
                histories.append(self.pools.token_ids[chunk.req_slot, :known])
                offsets.append(known + j)  # index of the token being sampled: seeds line up
                prompt_lens.append(self.prompt_lens[chunk.req_slot])
        out = self.sampler.sample(logits, rows, histories, offsets, prompt_lens)
        ids = out.token_ids.tolist()
        result, verify_slots, verify_rows = [], [], []
        for chunk, (first, count) in zip(chunks, batch.sample_rows):
            slot = chunk.req_slot
            samples = ids[first : first + count]
            if chunk.num_draft:
                drafts = self.pools.draft_tokens[slot, : chunk.num_draft].tolist()
                tokens = accept(drafts, samples)
                accepted[slot] = len(tokens)
                verify_slots.append(slot)
                verify_rows.append(len(tokens) - 1)
                n = chunk.start + 1
            else:
                tokens, n = samples, self.num_tokens[slot]
            self.pools.token_ids[slot, n : n + len(tokens)] = torch.tensor(tokens)
            self.num_tokens[slot] = n + len(tokens)
            logprob, top = out.logprobs[first], out.top_logprobs[first]
            result.append(
                SampledTokens(
                    slot,
                    tokens,
                    None if logprob is None else [logprob],
                    None if top is None else [top],
                )
            )
        commit_gdn(self.pools.gdn_layers, verify_slots, verify_rows, self.device)
        return result

    def _extend_rows(self, batch: StepBatch, accepted: dict[int, int]) -> list[ExtendRows]:
        rows, first = [], 0
        for chunk in batch.chunks:
            count = accepted.get(chunk.req_slot, chunk.num_tokens)
            if chunk.req_slot in self.mtp_slots:
                rows.append(
                    ExtendRows(
                        chunk.req_slot,
                        first,
                        chunk.start,
                        count,
                        list(chunk.kv_slots[:count]),
                        chunk.sample,
                    )
                )
            first += chunk.num_tokens
        return rows
