"""The model runner: owns the model, the pools, the request table and the sampler on one TP rank,
and executes StepPlans (admit/release -> batch -> forward -> sample -> commit -> MTP draft).

Called by the worker process loop (appliance/engine/worker.py) and by the offline `LLM`. Every rank
executes every plan; sampling is deterministic (seeded per request), so rank 0's result is the
result.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from appliance import envs
from appliance.config import EngineConfig
from appliance.engine.batch import StepBatch, build_batch
from appliance.engine.busy import BusyMeter
from appliance.engine.draft_graphs import DraftGraphs, draft_graph_reserve_bytes
from appliance.engine.graphs import (
    DecodeGraphs,
    capture_logged,
    graph_max_bs,
    graph_reserve_bytes,
)
from appliance.engine.guided import GuidedDecoding
from appliance.engine.memory import RunnerMemory
from appliance.engine.mm_inputs import MultimodalInputs
from appliance.engine.mtp import Drafter, accept_and_commit, extend_rows
from appliance.engine.mtp_costs import verify_costs
from appliance.engine.mtp_graphs import (
    MtpGraphs,
    is_full_verify,
    mtp_graph_max_bs,
    mtp_graph_reserve_bytes,
)
from appliance.engine.pending import PendingStep
from appliance.engine.pools import (
    Pools,
)
from appliance.engine.prefill_graphs import (
    PrefillGraphs,
    prefill_buckets,
    prefill_graph_reserve_bytes,
)
from appliance.engine.profiler import StepProfiler
from appliance.engine.prompt_logprobs import score_prompts
from appliance.engine.requests import RequestTable
from appliance.engine.sampler import Sampler, SamplerOutput
from appliance.engine.transfer import to_device
from appliance.engine.verify_edits import VerifyEdits, sampling_rows
from appliance.generation_defaults import end_token_ids
from appliance.logging import get_logger
from appliance.messages import (
    ProfileReport,
    PromptScores,
    SampledTokens,
    ScheduledChunk,
    StepPlan,
    StepResult,
    WorkerInfo,
)
from appliance.models.config import TextConfig, load_text_config
from appliance.models.context import forward_context
from appliance.models.layers.parallel import set_tp
from appliance.models.loader import (
    CheckpointMismatch,
    init_dummy_weights,
    iter_tensors,
    load_weights,
    unscaled_fp8_problem,
)
from appliance.models.registry import draft_factory, model_class
from appliance_kernels import backends, triton_utils
from appliance_kernels.fp8 import FP8_DTYPE
from appliance_kernels.kv_cache import KV_CACHE_DTYPES
from visual.shm import SharedMemoryImageStore

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GUIDE_POLL_S = 0.02  # an empty plan (the router waits for grammars) is answered within this


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class ModelRunner(RunnerMemory):
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
        if not config.model.model_dir:
            raise ValueError("model_dir: the runner needs a checkpoint folder (resolve it first)")
        self.model_dir = Path(config.model.model_dir)
        self.text_config: TextConfig = load_text_config(self.model_dir, config.model.quantization)
        self.device = resolve_device(config.parallel.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        dtype = config.model.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = _DTYPES[dtype]
        kv_dtype = config.cache.kv_cache_dtype
        self.kv_dtype = self.dtype if kv_dtype == "auto" else KV_CACHE_DTYPES[kv_dtype]
        self.backends = backends.configure(
            attention=config.kernels.attention_backend, **envs.kernel_backends()
        )
        # a float32 model's decode-graph capture failed under PDL in the cuBLAS SGEMM after a PDL
        # kernel (docs/benchmarks.md, run AT): 16-bit models only
        triton_utils.USE_PDL = envs.APPLIANCE_ENABLE_PDL and self.dtype != torch.float32
        log.info(
            "kernel backends: %s; programmatic dependent launch %s",
            ", ".join(f"{k} {v}" for k, v in self.backends.items()),
            "on" if triton_utils.pdl(torch.empty(0, device=self.device)) else "off",
        )
        self.graph_max_bs = graph_max_bs(
            config.graphs,
            config.scheduler.max_num_seqs,
            self.device,
            self.backends.get("attention", ""),
        )
        # short prefill steps as graphs: with the decode graphs, a Triton GDN prefill (the
        # external backends pack and sync on the host) and a context that holds a bucket
        self.prefill_graph_tokens = 0
        if self.graph_max_bs and self.backends.get("gdn_prefill", "triton") == "triton":
            self.prefill_graph_tokens = config.graphs.cuda_graph_max_prefill_tokens
        self.model = self._build_model()
        self.max_model_len = config.model.max_model_len or self.text_config.max_context
        scaling = self.text_config.rope_scaling
        if scaling is not None:
            log.info(
                "rope %s, factor %g: positions up to %d (max_position_embeddings %d)",
                scaling.rope_type,
                scaling.factor,
                self.text_config.max_context,
                self.text_config.max_position_embeddings,
            )
        self.eos_token_ids = self._eos_ids()
        self.mtp_step = config.scheduler.mtp_step
        # the fused MTP step (graphed where decode is), else acceptance on the host
        off = config.graphs.disable_mtp_fused_graph or envs.APPLIANCE_DISABLE_MTP_FUSED_GRAPH
        self.mtp_fused = not off
        self.draft_modules = self._build_drafts() if self.mtp_step else []
        self.pools = Pools(
            [self.model, *self.draft_modules],
            self._pool_sizes(),
            self.dtype,
            self.device,
            self.kv_dtype,
        )
        if self.kv_dtype != self.dtype:
            self.pools.log_kv_scales([self.model, *self.draft_modules])
        sizes = self.pools.sizes
        self.num_kv_slots = sizes.num_kv_slots
        self.num_snapshot_slots = sizes.num_snapshot_slots
        self.linear_state = bool(self.pools.gdn_layers)  # a prefix hit restores a GDN snapshot
        if self.max_model_len > self.num_kv_slots:
            # A context the KV pool cannot hold would be advertised and then refused (a request
            # without max_tokens asks for all of it): serve what one request can really use. Only
            # a context the user asked for is worth a warning; the checkpoint's default is not.
            level = logging.WARNING if config.model.max_model_len else logging.INFO
            log.log(
                level,
                "max_model_len %d is more than the KV pool holds (%d slots): serving %d",
                self.max_model_len,
                self.num_kv_slots,
                self.num_kv_slots,
            )
            self.max_model_len = self.num_kv_slots
            # the request table and the drafter need no column past the context served
            sizes = dataclasses.replace(sizes, max_model_len=self.max_model_len)
        self.requests = RequestTable(
            sizes.num_req_rows, sizes.max_model_len, self.mtp_step, self.device
        )
        self.drafter = None
        if self.mtp_step:
            self.drafter = Drafter(
                self.model,
                self.draft_modules,
                self.mtp_step,
                self.requests,
                sizes,
                self.device,
                config.scheduler.mtp_draft_vocab,
            )
        self.sampler = Sampler(config.model.logprobs_mode)
        # structured outputs: grammar matchers of guided requests (xgrammar loaded on first use)
        self.guided = GuidedDecoding(
            self._load_tokenizer, self.text_config.vocab_size, self.eos_token_ids
        )
        # image inputs (M-RoPE layout, embeddings to splice); tests may swap `self.mm.store`
        self.mm = MultimodalInputs(
            self.text_config,
            getattr(self.model, "num_deepstack", 0),
            SharedMemoryImageStore(),
            self.device,
            self.dtype,
        )
        # last: the pools and the table must exist
        self.graphs = self._decode_graphs() if self.graph_max_bs else None
        self.prefill_graphs = self._prefill_graphs() if self.prefill_graph_tokens else None
        self.mtp_graphs = self._mtp_graphs() if self.drafter is not None else None
        self.draft_graphs = self._draft_graphs()
        self.mtp_verify_costs = self._verify_costs()
        self._pending: collections.deque[PendingStep] = collections.deque()
        self._metered: collections.deque[bool] = collections.deque()  # busy meter, per pending
        self.busy = BusyMeter(envs.APPLIANCE_GPU_BUSY_LOG if rank == 0 else 0.0, self.device)
        self.profiler = StepProfiler(rank, world_size, self.device)
        self._profile_reports: dict[int, ProfileReport] = {}  # step id -> its plan's action's

    # ------------------------------------------------------------------ startup
    def _build_model(self) -> torch.nn.Module:
        cfg = self.text_config
        cls = model_class(cfg)
        if cfg.quant is not None and self.config.model.load_format != "dummy":
            problem = unscaled_fp8_problem(self.model_dir)  # before any memory is taken
            if problem is not None:
                raise CheckpointMismatch(problem)
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
            load_weights(model, iter_tensors(self.model_dir), tied, cfg.quant)
        log.info(
            "loaded %s (%s) in %.2fs on %s",
            cfg.architecture,
            self.dtype,
            time.perf_counter() - start,
            self.device,
        )
        if cfg.quant is not None:
            fp8 = sum(p.numel() for p in model.parameters() if p.dtype == FP8_DTYPE)
            total = sum(p.numel() for p in model.parameters())
            share = 100.0 * fp8 / max(total, 1)
            log.info(
                "quantization: %s; %.1f%% of the parameters in fp8", cfg.quant.describe(), share
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
                tensors = iter_tensors(self.model_dir, prefix="mtp.")
                load_weights(module, tensors, quant=self.text_config.quant)
            module.eval()
        log.info(
            "MTP: %s mode, %d draft step(s), %d draft module(s)",
            sched.mtp_mode,
            self.mtp_step,
            len(modules),
        )
        return modules

    def _decode_graphs(self) -> DecodeGraphs:
        cfg, sizes = self.text_config, self.pools.sizes
        graphs = DecodeGraphs(
            self.model,
            self.requests,
            sizes,
            self.graph_max_bs,
            cfg.hidden_size,
            cfg.vocab_size,
            self.dtype,
            self.device,
        )
        capture_logged("decode", graphs, graph_reserve_bytes(self.graph_max_bs, cfg.vocab_size))
        return graphs

    def _prefill_graphs(self) -> PrefillGraphs | None:
        """Short prefill steps as CUDA graphs; a capture that fails leaves them eager."""
        cfg, sizes = self.text_config, self.pools.sizes
        tokens = min(self.prefill_graph_tokens, self.max_model_len)
        if not prefill_buckets(tokens):
            return None
        graphs = PrefillGraphs(
            self.model, self.requests, sizes, tokens, cfg.vocab_size, self.device
        )
        reserve = prefill_graph_reserve_bytes(tokens, cfg.hidden_size, cfg.vocab_size)
        try:
            capture_logged("prefill", graphs, reserve)
        except RuntimeError as exc:  # (an op that cannot be captured: report, run eagerly)
            log.warning("prefill CUDA graphs off, their capture failed: %s", exc)
            return None
        return graphs

    def _mtp_graphs(self) -> MtpGraphs | None:
        """The device-resident MTP step: captured with the decode graphs, else run eagerly."""
        if not self.mtp_fused:
            log.info("MTP: fused step off (--disable-mtp-fused-graph): accept on the host")
            return None
        sizes = self.pools.sizes
        max_bs = mtp_graph_max_bs(self.graph_max_bs, self.mtp_step) or sizes.num_req_slots
        graphs = MtpGraphs(
            self.model,
            self.draft_modules,
            self.pools,
            self.requests,
            sizes,
            max_bs,
            self.text_config.hidden_size,
            self.dtype,
            self.device,
            draft_vocab=self.config.scheduler.mtp_draft_vocab,
            vocab_size=self.text_config.vocab_size,
        )
        if self.graph_max_bs:
            reserve = mtp_graph_reserve_bytes(max_bs, self.mtp_step, self.text_config.vocab_size)
            capture_logged("MTP verify + draft", graphs, reserve)
        return graphs

    def _draft_graphs(self) -> DraftGraphs | None:
        """The draft pass after decode-graph steps of MTP requests that verify no drafts (the
        router's verify policy), captured beside the decode graphs; none without them, or if the
        capture fails (such steps then draft on the host path)."""
        if self.graphs is None or self.mtp_graphs is None:
            return None
        sched, vocab = self.config.scheduler, self.text_config.vocab_size
        graphs = DraftGraphs(
            self.graphs,
            self.draft_modules,
            self.pools.sizes,
            self.mtp_step,
            sched.mtp_draft_vocab,
            self.device,
        )
        reserve = draft_graph_reserve_bytes(graphs.max_bs, vocab, sched.mtp_draft_vocab)
        try:
            capture_logged("MTP draft after decode", graphs, reserve)
        except RuntimeError as exc:  # (an op that cannot be captured: report, draft on the host)
            log.warning("MTP draft graphs off, their capture failed: %s", exc)
            return None
        return graphs

    def _verify_costs(self) -> dict[int, float]:
        """Verify over paused step time per captured verify batch (engine/mtp_costs.py)."""
        if self.draft_graphs is None or not self.draft_graphs.graphs:
            return {}
        try:
            costs = verify_costs(self.mtp_graphs, self.graphs, self.draft_graphs)
        except RuntimeError as exc:  # the router then verifies up to the largest verify graph
            log.warning("MTP verify costs not measured: %s", exc)
            return {}
        shown = ", ".join(f"{bs}: {cost:.2f}" for bs, cost in costs.items())
        log.info("MTP verify step time over a plain decode + draft pass, by batch: %s", shown)
        return costs

    def info(self) -> WorkerInfo:
        """What the router needs to know about this worker's pools (rank 0 reports it)."""
        return WorkerInfo(
            self.num_kv_slots,
            self.max_model_len,
            list(self.eos_token_ids),
            self.num_snapshot_slots,
            self.linear_state,
            self.mtp_graphs.max_bs if self.mtp_graphs is not None and self.graph_max_bs else 0,
            self.mtp_verify_costs,
        )

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    def _eos_ids(self) -> tuple[int, ...]:
        return end_token_ids(self.model_dir)

    # ------------------------------------------------------------------ steps
    @property
    def num_tokens(self) -> list[int]:
        """Tokens known per request slot (host mirror of the request table; ops/bench reads it)."""
        return self.requests.num_tokens_host

    def _admit(self, plan: StepPlan) -> None:
        saves = plan.snapshot_saves  # ended requests' states, before their slots are released
        self.pools.save_snapshots([s.req_slot for s in saves], [s.snapshot for s in saves])
        self.requests.release(plan.released_slots)
        self.guided.release(plan.released_slots)
        for slot in plan.released_slots:
            self.mm.release(slot)
        for req in plan.new_requests:
            self.mm.admit(req)
            if req.sampling.guide is not None:
                prompt_len = req.num_prompt_tokens if req.num_prompt_tokens >= 0 else None
                outputs = req.token_ids[prompt_len:] if prompt_len is not None else []
                self.guided.admit(req.req_slot, req.sampling.guide, outputs)
        self.requests.admit(plan.new_requests)
        hits = [req for req in plan.new_requests if req.restore_snapshot >= 0]
        self.pools.restore_snapshots(
            [req.restore_snapshot for req in hits], [req.req_slot for req in hits]
        )

    def _save_chunk_snapshots(self, chunks: list[ScheduledChunk]) -> None:
        """States the router asked to keep for its prefix cache, after the step's forward."""
        saves = [c for c in chunks if c.save_snapshot >= 0]
        self.pools.save_snapshots([c.req_slot for c in saves], [c.save_snapshot for c in saves])

    # The worker loop (and the offline engine) submit a plan and collect results in order; up to
    # two steps are in flight, so step N+1 is launched while the GPU still runs step N.
    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def execute(self, plan: StepPlan) -> StepResult:
        """One step, start to finish (nothing else may be in flight)."""
        assert not self._pending, "execute() with steps in flight: use submit() / collect()"
        self.submit(plan)
        return self.collect()

    def submit(self, plan: StepPlan) -> None:
        metered = bool(plan.chunks)  # an empty plan (grammars compiling) is no device step
        if plan.profile is not None:  # before the step: a start profiles it, a stop does not
            self._profile_reports[plan.step_id] = self.profiler.apply(plan.profile)
        if self._pending and self._pending[-1].deferred is not None:
            # (the worker collects before it submits again; other callers may not) the held-back
            # sampling writes tokens this plan's forward reads: finish the steps before it first
            for pending in list(self._pending)[:-1]:
                pending.result()
            self._pending[-1].launch_deferred()
        if metered:
            self.busy.begin()
        with self.profiler.step(plan.step_id, metered):
            self._pending.append(self._launch(plan))
        self._metered.append(metered)
        if metered:
            self.busy.end()

    def oldest_done(self) -> bool:
        """The oldest submitted step's result is ready (its device work has finished)."""
        return bool(self._pending) and self._pending[0].is_done()

    def collect(self) -> StepResult:
        """The oldest submitted step's result (waits for its device work)."""
        result = self._pending.popleft().result()
        if self._pending:  # a guided step's sampling waited for this result: behind its forward
            with torch.inference_mode():  # as the rest of its launch ran
                self._pending[0].launch_deferred()
        metered = self._metered.popleft()
        if metered:
            self.busy.collected()
        ready = self.guided.newly_compiled() if self.guided else []
        if ready:
            result = msgspec.structs.replace(result, guides_ready=ready)
        report = self._profile_reports.pop(result.step_id, None)
        if report is not None:
            result = msgspec.structs.replace(result, profile=report)
        return result

    @torch.inference_mode()
    def _launch(self, plan: StepPlan) -> PendingStep:
        pending = self._launch_step(plan)
        self._save_chunk_snapshots(plan.chunks)  # behind the step's device work, in order
        return pending

    def _launch_step(self, plan: StepPlan) -> PendingStep:
        start = time.perf_counter()
        self._admit(plan)
        if not plan.chunks:  # the router waits for grammars: answer when one is compiled
            self.guided.wait_compiling(GUIDE_POLL_S)
            return PendingStep.ready(StepResult(plan.step_id, [], 0.0))
        chunks = plan.chunks
        fused = self._fused_mtp_part(chunks)
        scores: list[PromptScores] = []  # prompt logprobs of the step's eager chunks
        if fused:
            # the full verify chunks on the device; the rest of the step (prefill chunks, plain
            # decodes, clamped verifies) first, on the host path, its results joined to the step's
            rest = [c for c in chunks if c not in fused]
            known: list[SampledTokens] = []
            if rest:
                batch, hidden, logits = self._forward_eager(rest)
                scores = self._score_prompts(batch, hidden)
                known = self._finish_on_host(batch, hidden, logits)
            return self._launch_mtp(plan.step_id, start, fused, known, scores)
        drafts_on_device = False  # the step's MTP requests draft through the draft graphs
        if self._graph_step(chunks):
            batch, hidden, logits = self._replay(chunks)
            drafts_on_device = self.draft_graphs is not None
        elif self._prefill_graph_step(chunks):
            batch, hidden, logits = self._replay_prefill(chunks[0])
        else:
            batch, hidden, logits = self._forward_eager(chunks)
            scores = self._score_prompts(batch, hidden)
        if logits is not None and self._device_resident(batch, drafts_on_device):
            return self._launch_sampling(
                plan.step_id, start, batch, logits, scores, drafts_on_device
            )
        sampled = self._finish_on_host(batch, hidden, logits)
        elapsed = time.perf_counter() - start
        return PendingStep.ready(StepResult(plan.step_id, sampled, elapsed, scores))

    def _score_prompts(self, batch: StepBatch, hidden: torch.Tensor) -> list[PromptScores]:
        """Prompt logprobs of the batch's chunks whose requests ask for them (usually none)."""
        return score_prompts(batch, hidden, self.requests, self.model.compute_logits)

    def _forward_eager(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[StepBatch, torch.Tensor, torch.Tensor | None]:
        batch = build_batch(chunks, self.requests, self.device)
        hidden = self.forward_batch(batch)
        logits = None
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
        return batch, hidden, logits

    def _finish_on_host(
        self, batch: StepBatch, hidden: torch.Tensor, logits: torch.Tensor | None
    ) -> list[SampledTokens]:
        """Sampling, MTP acceptance and the draft pass with the host reading the samples."""
        sampled: list[SampledTokens] = []
        if logits is not None and self.guided:
            self._settle_guided(batch.sample_chunks)
        if logits is not None:
            sampled = self._commit(batch, self._sample(logits, batch))
            if self.guided:
                self._advance_guided(sampled)
        if self.drafter is not None:
            accepted = {  # req slot -> rows committed this step (verify chunks)
                tokens.req_slot: len(tokens.token_ids)
                for chunk, tokens in zip(batch.sample_chunks, sampled)
                if chunk.num_draft
            }
            self.drafter.run(hidden, extend_rows(batch.chunks, accepted, self.requests))
        return sampled

    def _settle_guided(self, chunks: list[ScheduledChunk]) -> None:
        """Before masks are filled on the host path: the results of the steps in flight (their
        device-resident guided rows reach the matchers only when collected; computed now, kept
        for collect())."""
        if any(c.req_slot in self.guided for c in chunks):
            for pending in self._pending:
                pending.result()

    def _device_resident(self, batch: StepBatch, drafts_on_device: bool) -> bool:
        """The step's tokens can stay on the device (written into the request table there) with
        one non-blocking copy to the host: no MTP request in it unless the draft graphs draft
        for it (else its drafts follow on the host path), no logprobs. Guided requests' matchers
        read their tokens when the result is collected (_launch_sampling)."""
        table = self.requests
        if not drafts_on_device and any(table.uses_mtp(c.req_slot) for c in batch.chunks):
            return False
        return all(table.options[c.req_slot].logprobs is None for c in batch.sample_chunks)

    def _launch_sampling(
        self,
        step_id: int,
        start: float,
        batch: StepBatch,
        logits: torch.Tensor,
        scores: list[PromptScores],
        drafts_on_device: bool = False,
    ) -> PendingStep:
        chunks = batch.sample_chunks
        draft = drafts_on_device and any(self.requests.uses_mtp(c.req_slot) for c in chunks)
        slots = [c.req_slot for c in chunks]
        guided = bool(self.guided) and any(slot in self.guided for slot in slots)
        committed = self._guided_on_collect(slots) if guided else None

        def launch(pending: PendingStep) -> None:
            out = self._sample(logits, batch)  # [S] on the device, one row per (plain) chunk
            self._write_plain(chunks, out.token_ids)
            pending.start_copy(out.token_ids)
            if draft:  # behind the copy: the host waits for the tokens, not for the drafts
                self.draft_graphs.run(len(chunks))

        pending = PendingStep(step_id, start, slots=slots, scores=scores, committed=committed)
        if guided and any(p.done is None for p in self._pending):
            # the masks need the matchers past the step in flight: sampling is launched when
            # that step is collected (collect()), while this step's forward runs
            pending.deferred = launch
        else:
            launch(pending)
        return pending

    def _write_plain(self, chunks: list[ScheduledChunk], token_ids: torch.Tensor) -> None:
        """The token each plain sampling chunk sampled [len(chunks)] goes after its last row."""
        positions = [c.start + c.num_tokens for c in chunks]
        self.requests.write_sampled([c.req_slot for c in chunks], positions, token_ids)

    def _fused_mtp_part(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The step's chunks that the fused MTP step takes (engine/mtp_graphs.py): verify chunks
        of requests decoding with all k drafts, none with images; none if they are more than its
        largest batch. Guided requests join when no step is in flight (their masks are filled from
        matchers that have read every committed token; the router plans nothing while an MTP
        decode is in flight, so this is the usual case)."""
        if self.mtp_graphs is None:
            return []
        k = self.mtp_graphs.k
        picked = [
            c
            for c in chunks
            if is_full_verify([c], k)
            and c.req_slot not in self.mm.requests
            and (c.req_slot not in self.guided or not self._pending)
        ]
        return picked if len(picked) <= self.mtp_graphs.max_bs else []

    def _launch_mtp(
        self,
        step_id: int,
        start: float,
        chunks: list[ScheduledChunk],
        known: list[SampledTokens],
        scores: list[PromptScores],
    ) -> PendingStep:
        bitmask = self._grammar_bitmask(chunks) if self.guided else None
        edits = VerifyEdits.of(chunks, self.requests, self.sampler.mode)
        edit = None if edits is None else edits.apply
        out = self.mtp_graphs.run(chunks, bitmask, edit)  # [n, k + 2] on the device
        slots = [c.req_slot for c in chunks]
        return PendingStep.copying(
            step_id,
            start,
            slots,
            out,
            None if edits is None else edits.pack(out),
            scored=[] if edits is None else edits.scored_requests(),
            lengths=self.requests.lengths_on_collect(slots),
            starts=[c.start for c in chunks],
            known=known,
            scores=scores,
            committed=self._guided_on_collect(slots) if bitmask is not None else None,
        )

    def _guided_on_collect(self, slots: list[int]) -> Callable[[list[SampledTokens]], None]:
        """Advances the matchers by a launched step's runs when its result arrives, skipping
        slots released (or given to another request) since the launch."""
        admitted = [self.requests.admissions[slot] for slot in slots]

        def advance(sampled: list[SampledTokens]) -> None:
            table = self.requests
            self._advance_guided(
                [t for t, epoch in zip(sampled, admitted) if table.admissions[t.req_slot] == epoch]
            )

        return advance

    def _advance_guided(self, sampled: list[SampledTokens]) -> None:
        """Guided requests' matchers read the tokens their requests committed this step."""
        for tokens in sampled:
            self.guided.advance(tokens.req_slot, tokens.token_ids)

    def _graph_step(self, chunks: list[ScheduledChunk]) -> bool:
        """A step the decode graphs can replay: plain one-token decodes, none with images."""
        if self.graphs is None or not self.graphs.can_run(chunks):
            return False
        return not any(c.req_slot in self.mm.requests for c in chunks)

    def _prefill_graph_step(self, chunks: list[ScheduledChunk]) -> bool:
        """A step the prefill graphs can replay: one short chunk of a request with no images,
        no MTP (the drafter reads every row's hidden state) and no prompt logprobs."""
        if self.prefill_graphs is None or len(chunks) != 1:
            return False
        chunk, table = chunks[0], self.requests
        options = table.options[chunk.req_slot]
        return (
            self.prefill_graphs.can_run(chunk)
            and not table.uses_mtp(chunk.req_slot)
            and chunk.req_slot not in self.mm.requests
            and (options is None or options.prompt_logprobs is None)
        )

    def _replay_prefill(self, chunk: ScheduledChunk) -> tuple[StepBatch, None, torch.Tensor | None]:
        """Replays a prefill graph; the batch describes the chunk for sampling (its last row)."""
        rows, logits = self.prefill_graphs.run(chunk)
        batch = StepBatch(
            chunks=[chunk],
            input_ids=self.requests.token_ids[0, :0],  # not read after the forward
            positions=self.prefill_graphs.rows.meta[1, : chunk.num_tokens],
            ctx=self.prefill_graphs.contexts[rows],
            logits_indices=self.prefill_graphs.zero,
            sample_rows=[(0, 1)] if chunk.sample else [],
        )
        return batch, None, logits if chunk.sample else None

    def _replay(self, chunks: list[ScheduledChunk]) -> tuple[StepBatch, torch.Tensor, torch.Tensor]:
        """Replays the decode graph; the batch describes its rows for sampling and drafting."""
        bs, hidden, logits = self.graphs.run(chunks)
        n = len(chunks)
        batch = StepBatch(
            chunks=list(chunks),
            input_ids=self.requests.token_ids[0, :0],  # not read after the forward
            positions=self.graphs.meta[1, :n],
            ctx=self.graphs.contexts[bs],
            logits_indices=self.graphs.cu_seqlens[:n],
            sample_rows=[(i, 1) for i in range(n)],
        )
        return batch, hidden, logits

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

    def _sample(self, logits: torch.Tensor, batch: StepBatch) -> SamplerOutput:
        """One token per row of logits [S, V]: a plain chunk's last row, or all k + 1 rows of a
        verify chunk, each at its own sequence offset so seeds line up with plain decoding, and
        after its drafts (engine/verify_edits.py)."""
        rows = sampling_rows(batch.sample_chunks, self.requests)
        bitmask = self._grammar_bitmask(batch.sample_chunks) if self.guided else None
        return self.sampler.sample(
            logits, rows.options, rows.histories, rows.offsets, rows.prompt_lens, bitmask
        )

    def _grammar_bitmask(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """The token masks [S, ceil(V / 32)] (host) of the sampling chunks' rows, verify rows
        after their drafts; None when none of them is guided."""
        verify = [c.req_slot for c in chunks if c.num_draft and c.req_slot in self.guided]
        drafts: dict[int, list[int]] = {}
        if verify:
            index = to_device(verify, torch.int64, self.device)
            drafts = dict(zip(verify, self.requests.draft_tokens[index].tolist()))
        rows = [
            (c.req_slot, drafts.get(c.req_slot, [0] * c.num_draft)[: c.num_draft]) for c in chunks
        ]
        return self.guided.bitmask(rows)

    def _commit(self, batch: StepBatch, out: SamplerOutput) -> list[SampledTokens]:
        """The tokens each sampling chunk gained, written into the request table: a plain chunk's
        sample, or a verify chunk's accepted run (MTP accept + GDN commit in engine/mtp.py)."""
        chunks = batch.sample_chunks
        ids = out.token_ids.tolist()
        tokens = [ids[first : first + count] for first, count in batch.sample_rows]
        plain = [i for i, c in enumerate(chunks) if not c.num_draft]
        verify = [i for i, c in enumerate(chunks) if c.num_draft]
        if plain:
            rows = to_device([batch.sample_rows[i][0] for i in plain], torch.int64, self.device)
            self._write_plain([chunks[i] for i in plain], out.token_ids[rows])
        accepted = accept_and_commit(
            [chunks[i] for i in verify],
            [tokens[i] for i in verify],
            self.requests,
            self.pools,
        )
        for i, run in zip(verify, accepted):
            tokens[i] = run
        result = []
        for chunk, (first, _), new in zip(chunks, batch.sample_rows, tokens):
            scored = out.logprobs[first] is not None  # the accepted rows' logprobs, in order
            last = first + len(new)
            result.append(
                SampledTokens(
                    chunk.req_slot,
                    new,
                    out.logprobs[first:last] if scored else None,
                    out.top_logprobs[first:last] if scored else None,
                )
            )
        return result
