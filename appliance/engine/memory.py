"""Memory planning of the model runner: how many KV slots, state snapshots and request rows its
pools get. On a GPU: weights (loaded) -> a worst-case profile forward -> hold back the ViT's
reservation and the CUDA-graph pools -> `mem_fraction` of the rest (or what vLLM's
gpu_memory_utilization share of the whole device leaves), less the state pools and the
prefix-cache snapshots, becomes the KV pool. On CPU the sizes come from the configuration.
A mixin of ModelRunner (appliance/engine/runner.py), which owns every attribute it reads."""

from __future__ import annotations

import torch

from appliance.engine.batch import build_batch
from appliance.engine.draft_graphs import draft_graph_reserve_bytes
from appliance.engine.graphs import graph_reserve_bytes
from appliance.engine.mtp_graphs import mtp_graph_max_bs, mtp_graph_reserve_bytes
from appliance.engine.pools import (
    Pools,
    PoolSizes,
    kv_bytes_per_slot,
    plan_kv_slots,
    plan_snapshot_slots,
    state_bytes_per_slot,
)
from appliance.engine.prefill_graphs import prefill_graph_reserve_bytes
from appliance.engine.requests import RequestTable
from appliance.logging import get_logger
from appliance.messages import ScheduledChunk
from appliance.models.context import forward_context

log = get_logger(__name__)


class NotEnoughDeviceMemory(MemoryError):
    """The pools do not fit beside the weights (ipc.run_role reports it in one line)."""


CPU_DEFAULT_KV_SLOTS = 32768


class RunnerMemory:
    """`_pool_sizes()` and what it measures; mixed into ModelRunner."""

    def _pool_sizes(self) -> PoolSizes:
        sched = self.config.scheduler
        slots = sched.num_kv_slots
        snapshots = self._num_snapshots(None)
        if not slots and self.device.type == "cuda":
            slots, snapshots = self._slots_from_memory()
        elif self.device.type == "cuda":  # a fixed KV pool: the auto snapshot pool fits beside it
            state, per_slot = self._state_and_kv_slot_bytes()
            free, _ = torch.cuda.mem_get_info(self.device)
            pool = self._pool_bytes(free, 0) - state
            snapshots = self._num_snapshots(pool, slots * per_slot)
        elif not slots:
            slots = min(CPU_DEFAULT_KV_SLOTS, sched.max_num_seqs * self.max_model_len)
        padding = self.graph_max_bs > 0
        return PoolSizes(
            slots, sched.max_num_seqs, self.max_model_len, self.mtp_step, padding, snapshots
        )

    def _num_snapshots(self, pool_bytes: float | None, kv_bytes: int = 0) -> int:
        """Prefix-cache state snapshot slots: none without prefix caching or GDN layers; else
        plan_snapshot_slots over `pool_bytes` (None: no memory bound, CPU)."""
        per = state_bytes_per_slot(self.model, self.dtype)
        cache, sched = self.config.cache, self.config.scheduler
        if not sched.prefix_caching or per == 0:
            return 0
        return plan_snapshot_slots(
            cache.snapshot_slots,
            sched.max_num_seqs,
            per,
            pool_bytes,
            cache.snapshot_mem_fraction,
            kv_bytes,
        )

    def _pool_bytes(self, free: int, held: int) -> float:
        """Device memory the pools (KV, request state, snapshots) may take, from what is `free`
        now (weights loaded) less what is `held` back (activation peak, ViT, graphs):
        `mem_fraction` of the rest, or with gpu_memory_utilization u (vLLM's) what is left of u
        x the device's whole memory once everything in use and held back is counted."""
        cache = self.config.cache
        if cache.gpu_memory_utilization:
            _, total = torch.cuda.mem_get_info(self.device)
            return free - held - (1.0 - cache.gpu_memory_utilization) * total
        return (free - held) * cache.mem_fraction

    def _pool_rule(self) -> str:
        """The flag that sized the pools, for the startup log and its error."""
        cache = self.config.cache
        if cache.gpu_memory_utilization:
            return f"--gpu-memory-utilization {cache.gpu_memory_utilization}"
        return f"--mem-fraction {cache.mem_fraction}"

    def _state_and_kv_slot_bytes(self) -> tuple[int, int]:
        """Bytes of the request state pools (every request row) and of one KV slot (all models)."""
        rows = self.config.scheduler.max_num_seqs + (1 if self.graph_max_bs else 0)  # + padding
        state = state_bytes_per_slot(self.model, self.dtype, self.mtp_step) * rows
        per_slot = sum(
            kv_bytes_per_slot(m, self.kv_dtype) for m in [self.model, *self.draft_modules]
        )
        return state, per_slot

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
            self.kv_dtype,
        )
        probe_requests = RequestTable(1, tokens, self.mtp_step, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        probe_requests.token_ids[0, :tokens] = 0
        chunk = ScheduledChunk(0, 0, tokens, list(range(tokens)), True)
        batch = build_batch([chunk], probe_requests, self.device)
        with forward_context(batch.ctx):
            hidden = self.model(batch.input_ids, batch.positions)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del probe, probe_requests, batch, hidden
        torch.cuda.empty_cache()
        return peak

    def _slots_from_memory(self) -> tuple[int, int]:
        """Startup order: weights (loaded) -> worst-case profile forward -> hold back the ViT
        reservation and the graphs -> the pools' memory (_pool_bytes), less the state pools and
        the snapshots, becomes the KV pool."""
        sched = self.config.scheduler
        activation = self._profile_activation_bytes()
        free, _ = torch.cuda.mem_get_info(self.device)
        state, per_slot = self._state_and_kv_slot_bytes()
        vocab = self.text_config.vocab_size
        graphs = graph_reserve_bytes(self.graph_max_bs, vocab)
        graphs += prefill_graph_reserve_bytes(
            min(self.prefill_graph_tokens, self.max_model_len), self.text_config.hidden_size, vocab
        )
        if self.mtp_step and self.mtp_fused:
            mtp_bs = mtp_graph_max_bs(self.graph_max_bs, self.mtp_step)
            graphs += mtp_graph_reserve_bytes(mtp_bs, self.mtp_step, vocab)
            graphs += draft_graph_reserve_bytes(self.graph_max_bs, vocab, sched.mtp_draft_vocab)
        held = activation + self.reserved_bytes + graphs
        pool = self._pool_bytes(free, held)
        snapshots = self._num_snapshots(pool - state)
        snapshot_bytes = snapshots * state_bytes_per_slot(self.model, self.dtype)
        scratch = sched.max_num_seqs * self.mtp_step
        slots = plan_kv_slots(pool, state + snapshot_bytes, per_slot, scratch)
        log.info(
            "memory: %.2f GiB free after weights, %.2f GiB activation peak, %.2f GiB reserved "
            "for the ViT, %.2f GiB for CUDA graphs; %.2f GiB for the pools (%s): %.2f GiB state "
            "pools, %.2f GiB for %d prefix-cache state snapshots -> %d KV slots of %d B (%s)",
            free / 2**30,
            activation / 2**30,
            self.reserved_bytes / 2**30,
            graphs / 2**30,
            pool / 2**30,
            self._pool_rule(),
            state / 2**30,
            snapshot_bytes / 2**30,
            snapshots,
            slots,
            per_slot,
            str(self.kv_dtype).removeprefix("torch."),
        )
        if slots < sched.max_num_batched_tokens:
            raise NotEnoughDeviceMemory(
                f"not enough device memory for the KV pool: {slots} slots fit "
                f"({self._pool_rule()}), "
                f"fewer than max_num_batched_tokens={sched.max_num_batched_tokens}"
            )
        return slots, snapshots
