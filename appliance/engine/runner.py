"""The model runner: owns the model, the pools and the sampler on one TP rank, and executes StepPlans.

Called by the worker process loop (appliance/engine/worker.py) and by the offline `LLM`. Every rank
executes every plan; sampling is deterministic (seeded per request), so rank 0's result is the result.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from appliance.config import EngineConfig
from appliance.engine.batch import StepBatch, build_batch
from appliance.engine.context import forward_context
from appliance.engine.pools import PoolSizes, Pools, kv_bytes_per_slot, state_bytes_per_slot
from appliance.engine.sampler import Sampler
from appliance.logging import get_logger
from appliance.messages import SampledTokens, SamplingOptions, StepPlan, StepResult
from appliance.models.config import TextConfig, load_text_config
from appliance.models.layers.parallel import set_tp
from appliance.models.loader import init_dummy_weights, iter_tensors, load_weights
from appliance.models.registry import model_class

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
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 tp_group=None) -> None:
        self.config = config
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
        self.model = self._build_model()
        self.max_model_len = config.model.max_model_len or self.text_config.max_position_embeddings
        self.eos_token_ids = self._eos_ids()
        self.pools = Pools(self.model, self._pool_sizes(), self.dtype, self.device)
        self.num_kv_slots = self.pools.sizes.num_kv_slots
        self.sampler = Sampler()
        self.options: dict[int, SamplingOptions] = {}
        self.prompt_lens: dict[int, int] = {}
        self.num_tokens: dict[int, int] = {}  # req_slot -> tokens known to this worker

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
            tied = {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_word_embeddings else {}
            load_weights(model, iter_tensors(self.model_dir), tied)
        log.info("loaded %s (%s) in %.2fs on %s", cfg.architecture, self.dtype,
                 time.perf_counter() - start, self.device)
        return model.eval()

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
        if not slots:
            per_slot = max(1, kv_bytes_per_slot(self.model, self.dtype))
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                state = state_bytes_per_slot(self.model, self.dtype) * sched.max_num_seqs
                budget = free * self.config.cache.mem_fraction - state
                slots = int(budget // per_slot)
            else:
                slots = min(CPU_DEFAULT_KV_SLOTS, sched.max_num_seqs * self.max_model_len)
        return PoolSizes(slots, sched.max_num_seqs, self.max_model_len)

    # ------------------------------------------------------------------ steps
    def _admit(self, plan: StepPlan) -> None:
        for slot in plan.released_slots:
            self.options.pop(slot, None)
            self.num_tokens.pop(slot, None)
            self.prompt_lens.pop(slot, None)
        for req in plan.new_requests:
            n = len(req.token_ids)
            self.pools.token_ids[req.req_slot, :n] = torch.tensor(req.token_ids)
            self.num_tokens[req.req_slot] = n
            self.options[req.req_slot] = req.sampling
            self.prompt_lens[req.req_slot] = req.num_prompt_tokens if req.num_prompt_tokens >= 0 else n

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        self._admit(plan)
        if not plan.chunks:
            return StepResult(plan.step_id, [], 0.0)
        batch: StepBatch = build_batch(plan.chunks, self.pools, self.device)
        with forward_context(batch.ctx):
            hidden = self.model(batch.input_ids, batch.positions)
        sampled: list[SampledTokens] = []
        if batch.sample_slots:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            sampled = self._sample(logits, batch.sample_slots)
        return StepResult(plan.step_id, sampled, time.perf_counter() - start)

    def _sample(self, logits: torch.Tensor, slots: list[int]) -> list[SampledTokens]:
        lengths = [self.num_tokens[s] for s in slots]
        histories = [self.pools.token_ids[s, :n] for s, n in zip(slots, lengths)]
        out = self.sampler.sample(logits, [self.options[s] for s in slots], histories, lengths,
                                  [self.prompt_lens[s] for s in slots])
        result = []
        for i, (slot, n) in enumerate(zip(slots, lengths)):
            token = int(out.token_ids[i])
            self.pools.token_ids[slot, n] = token
            self.num_tokens[slot] = n + 1
            logprob = out.logprobs[i]
            top = out.top_logprobs[i]
            result.append(SampledTokens(slot, [token], None if logprob is None else [logprob],
                                        None if top is None else [top]))
        return result
