"""Offline, in-process generation API (vLLM style): `LLM(model_dir).generate(prompts,
SamplingParams())`.

Runs the real scheduler and model runner in this process (TP=1), or with TP > 1 drives worker
processes through the same StepPlan broadcast the appliance uses. Used by scripts and by tests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from appliance.config import EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from appliance.detokenizer.incremental import RequestDetokenizer
from appliance.detokenizer.tokenizer import TextTokenizer
from appliance.messages import DetokParams
from appliance.router.request import Request
from appliance.router.scheduler import Scheduler
from appliance.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated ids
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None


def build_engine_config(model_dir: str | None, tp: int, options: dict) -> EngineConfig:
    """Splits flat keyword options over the per-role dataclasses; unknown names raise ValueError."""
    groups = {"model": ModelConfig(), "scheduler": SchedulerConfig(), "parallel": ParallelConfig()}
    values: dict[str, dict] = {k: {} for k in groups}
    for key, value in options.items():
        owner = next((g for g, cfg in groups.items() if hasattr(cfg, key)), None)
        if owner is None:
            raise ValueError(f"{key}: unknown option")
        values[owner][key] = value
    values["model"]["model_dir"] = str(model_dir or "")
    values["parallel"]["tp"] = tp
    return EngineConfig(
        model=replace(groups["model"], **values["model"]),
        scheduler=replace(groups["scheduler"], **values["scheduler"]),
        parallel=replace(groups["parallel"], **values["parallel"]),
    )


class LLM:
    def __init__(self, model_dir: str | None = None, tp: int = 1, **options) -> None:
        self.config = build_engine_config(model_dir, tp, options)
        from appliance.engine.runner import ModelRunner, resolve_model_dir

        self.model_dir = resolve_model_dir(self.config.model.model_dir)
        self.config = replace(
            self.config, model=replace(self.config.model, model_dir=str(self.model_dir))
        )
        if tp == 1:
            self.runner = ModelRunner(self.config)
            num_kv, max_len, eos = (
                self.runner.num_kv_slots,
                self.runner.max_model_len,
                self.runner.eos_token_ids,
            )
        else:  # worker processes over torch.distributed, driven through the StepPlan seam
            from appliance.launch import WorkerGroup

            self.runner = WorkerGroup(self.config)
            info = self.runner.info
            num_kv, max_len, eos = info.num_kv_slots, info.max_model_len, info.eos_token_ids
        self.eos_token_ids = tuple(eos)
        self.tokenizer = TextTokenizer.from_pretrained(self.model_dir)
        self.scheduler = Scheduler(self.config.scheduler, num_kv, max_len)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the worker processes (tp > 1); a no-op in process."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        outputs: dict[str, CompletionOutput] = {}
        detoks: dict[str, RequestDetokenizer] = {}
        order: list[str] = []
        for prompt, sp in zip(prompts, params_list):
            req_id = f"offline-{next(self._ids)}"
            ids = self._encode(prompt)
            self.scheduler.add_request(
                Request(
                    req_id=req_id,
                    prompt_token_ids=ids,
                    sampling=sp.to_options(),
                    max_tokens=sp.max_tokens,
                    eos_token_ids=frozenset(self.eos_token_ids),
                    stop_token_ids=frozenset(sp.stop_token_ids or ()),
                    ignore_eos=sp.ignore_eos,
                )
            )
            outputs[req_id] = CompletionOutput(
                prompt_token_ids=ids, logprobs=[] if sp.logprobs is not None else None
            )
            stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
            detoks[req_id] = RequestDetokenizer(self.tokenizer, DetokParams(stop=stops))
            order.append(req_id)
        while self.scheduler.has_work():
            plan = self.scheduler.schedule()
            if plan is None:
                break
            result = self.runner.execute(plan)
            for delta in self.scheduler.update(result):
                self._apply(delta, outputs[delta.req_id], detoks[delta.req_id])
        return [outputs[r] for r in order]

    def _apply(self, delta, out: CompletionOutput, detok: RequestDetokenizer) -> None:
        for i, token in enumerate(delta.new_token_ids):
            if detok.stopped:
                break  # an MTP run may carry tokens past the stop string: they are not output
            out.token_ids.append(token)
            if out.logprobs is not None and delta.logprobs is not None:
                out.logprobs.append(delta.logprobs[i])
            if delta.finished and delta.stop_token_id == token:
                continue  # the eos / stop token is not part of the text
            detok.add_token(token)
            if detok.stopped:
                self.scheduler.finish(delta.req_id)
                out.finish_reason = "stop"
        if delta.finished and out.finish_reason is None:
            out.finish_reason = delta.finish_reason.value
        if detok.stopped or delta.finished:
            detok.flush()
            out.text = detok.text
