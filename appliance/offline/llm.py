"""Offline, in-process generation API (vLLM style): `LLM(model).generate(prompts,
SamplingParams())`, `model` a folder or a Hub id.

The served path without sockets: the router's engine loop (router/engine.py) drives the model
runner in this process (TP=1) or worker processes (TP>1, offline/workers.py), and the served
detokenizer turns tokens into text, so stop ids, stop strings and lengths end a request exactly as
they do behind the HTTP server.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields, replace

from appliance.config import EngineConfig
from appliance.detokenizer.detokenizer import Detokenizer
from appliance.detokenizer.tokenizer import TextTokenizer
from appliance.generation_defaults import generation_defaults
from appliance.messages import Guide, TextDelta, TokenizedRequest
from appliance.router.engine import EngineCore
from appliance.router.scheduler import Scheduler
from appliance.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One choice of one prompt. `generate` returns them flat (the n choices of each prompt in
    turn); `outputs` also groups them as vLLM's RequestOutput does, so vLLM's
    `out[i].outputs[j].text` reads choice j (with n = 1, out[i] is prompt i's only choice, where
    vLLM's out[i] is prompt i's request output)."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated ids (a final stop id included)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    # SamplingParams.prompt_logprobs: each prompt token's logprob (None for the first)
    prompt_logprobs: list[float | None] | None = None
    index: int = 0  # which of the prompt's n choices
    prompt: str | None = None  # the prompt as given, when it was text
    # the prompt's choices, this one among them (vLLM's RequestOutput.outputs)
    outputs: list[CompletionOutput] = field(default_factory=list, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def build_engine_config(model_dir: str | None, tp: int, options: dict) -> EngineConfig:
    """Splits flat keyword options over the engine's config sections (model, scheduler, parallel,
    cache, kernels, graphs); unknown names raise ValueError naming the option."""
    sections = {f.name: f.default_factory() for f in fields(EngineConfig)}
    values: dict[str, dict] = {name: {} for name in sections}
    for key, value in options.items():
        owner = next((name for name, cfg in sections.items() if hasattr(cfg, key)), None)
        if owner is None:
            raise ValueError(f"{key}: unknown option")
        values[owner][key] = value
    values["model"]["model_dir"] = str(model_dir or "")
    values["parallel"]["tp"] = tp
    return EngineConfig(**{name: replace(cfg, **values[name]) for name, cfg in sections.items()})


def vllm_keywords(options: dict, tp: int) -> int:
    """vLLM's spellings of the same options, as `appliance serve` takes its flags
    (`tensor_parallel_size` for `tp`, `enforce_eager` ...): moved to ours in `options`; returns
    the tensor-parallel size. Theirs that mean something else here raise ValueError naming ours."""
    from appliance.flag_aliases import FLAG_ALIASES, FLAG_HINTS

    def keyword(flag: str) -> str:
        return flag.lstrip("-").replace("-", "_")

    for ours, flags in FLAG_ALIASES.items():
        for theirs in map(keyword, flags):
            if theirs in options:
                value = options.pop(theirs)
                if ours == "tp":
                    tp = value
                else:
                    options[ours] = value
    for theirs, hint in ((keyword(flag), hint) for flag, hint in FLAG_HINTS.items()):
        if theirs in options:
            raise ValueError(f"{theirs}: use {hint}")
    return tp


class LLM:
    """`model`: a checkpoint folder, a Hugging Face Hub id `ORG/NAME` (at `revision`, through the
    Hub cache, as `appliance serve` resolves it), or None for the embedded default model.
    `generate` without SamplingParams samples with `default_sampling_params()`: the model's
    generation_config.json (`generation_config="auto"`), `"none"` (SamplingParams' own defaults)
    or a folder's, as `appliance serve --generation-config`."""

    def __init__(
        self,
        model: str | None = None,
        tp: int = 1,
        revision: str = "",
        generation_config: str = "auto",
        **options,
    ) -> None:
        options = dict(options)
        tp = vllm_keywords(options, tp)
        self.config = build_engine_config(model, tp, options)
        from appliance.assets.resolve import resolve_model_dir
        from appliance.engine.runner import ModelRunner
        from appliance.models.config import load_text_config
        from appliance.models.layers.quant import UnsupportedQuantization
        from appliance.models.loader import CheckpointMismatch, unscaled_fp8_problem
        from appliance.models.registry import quant_layout_problem

        self.model_dir = resolve_model_dir(
            self.config.model.model_dir, revision, self.config.model.load_format
        )
        self.config = replace(
            self.config, model=replace(self.config.model, model_dir=str(self.model_dir))
        )
        text = load_text_config(self.model_dir, self.config.model.quantization)
        problem = text.tp_problem(tp)  # these checks: before any worker starts
        if problem is not None:
            raise ValueError(f"tp: {problem}")
        problem = quant_layout_problem(text, tp)
        if problem is not None:
            raise UnsupportedQuantization(problem)
        problem = text.context_problem(self.config.model.max_model_len)
        if problem is not None:
            raise ValueError(f"max_model_len: {problem}")
        if text.quant is not None and self.config.model.load_format != "dummy":
            problem = unscaled_fp8_problem(self.model_dir)
            if problem is not None:
                raise CheckpointMismatch(problem)
        self.sampling_defaults = generation_defaults(self.model_dir, generation_config)
        if tp == 1:
            self.runner = ModelRunner(self.config)
            info = self.runner.info()
        else:
            from appliance.offline.workers import WorkerGroup

            self.runner = WorkerGroup(self.config)
            info = self.runner.info
        self.eos_token_ids = tuple(info.eos_token_ids)
        self.tokenizer = TextTokenizer.from_pretrained(self.model_dir)
        self.scheduler = Scheduler(
            self.config.scheduler,
            info.num_kv_slots,
            info.max_model_len,
            num_snapshot_slots=info.num_snapshot_slots,
            linear_state=info.linear_state,
        )
        self.engine = EngineCore(self.scheduler, list(self.eos_token_ids), self.runner)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._ids = itertools.count()
        self._compiler = None  # checks guides (structured outputs) on first use

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams (the generation_config defaults)."""
        return SamplingParams(**self.sampling_defaults)

    def close(self) -> None:
        """Stops the worker processes (tp > 1); a no-op in process."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = len(self.tokenizer.hf)
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad!r} is not in the vocabulary (0..{vocab - 1})")
        return ids

    def _request(
        self, ids: list[int], params: SamplingParams, choice: int, fit: bool = False
    ) -> TokenizedRequest:
        """Choice `choice` of the prompt's n: a given seed is offset so the choices differ (as the
        server's choices). `fit`: max_tokens is the generation config's cap (max_new_tokens),
        not asked for, so it shrinks to the room the prompt leaves (as the server's does)."""
        if params.guide is not None:
            self._check_guide(params.guide)
        max_tokens = params.max_tokens
        if fit:  # a prompt with no room left still meets the scheduler's refusal
            max_tokens = min(max_tokens, max(1, self.scheduler.max_model_len - len(ids)))
        return TokenizedRequest(
            req_id=f"offline-{next(self._ids)}",
            prompt_token_ids=ids,
            sampling=params.choice_options(choice),
            max_tokens=max_tokens,
            ignore_eos=params.ignore_eos,
            stop_token_ids=list(params.stop_token_ids),
            detok=params.to_detok(),
        )

    def _check_guide(self, guide: Guide) -> None:
        """Raises GrammarError (a ValueError naming the problem) for a guide that does not
        compile, before the request reaches the workers (which compile it again, cached)."""
        if self._compiler is None:
            from transformers import AutoTokenizer

            from appliance.grammars import GrammarCompiler

            hf = AutoTokenizer.from_pretrained(str(self.model_dir))
            self._compiler = GrammarCompiler(lambda: hf, len(hf), list(self.eos_token_ids))
        self._compiler.submit(guide).result()

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Runs every prompt to its end: `n` outputs a prompt (SamplingParams.n), prompt by prompt,
        as the server numbers choices. A prompt the scheduler refuses raises its error (a
        ValueError, or QueueFull); any error or interrupt (KeyboardInterrupt) drops every request
        of the call, so the LLM serves the next call as new."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.default_sampling_params()
        fit = sampling_params is None and "max_tokens" in self.sampling_defaults
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(
                f"sampling_params: {len(params)} given for {len(prompts)} prompts (give one, or "
                "one a prompt)"
            )
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        for sp in {id(sp): sp for sp in params_list}.values():
            sp.check_vocabulary(len(self.tokenizer.hf))
        outputs: dict[str, CompletionOutput] = {}
        open_ids: set[str] = set()
        try:
            for prompt, sp in zip(prompts, params_list):
                ids = self._prompt_ids(prompt)
                choices: list[CompletionOutput] = []
                for choice in range(sp.n):
                    req = self._request(ids, sp, choice, fit)
                    self.engine.enqueue(req)
                    outputs[req.req_id] = out = CompletionOutput(
                        prompt_token_ids=req.prompt_token_ids,
                        logprobs=[] if sp.logprobs is not None else None,
                        index=choice,
                        prompt=prompt if isinstance(prompt, str) else None,
                        outputs=choices,
                    )
                    choices.append(out)
                    open_ids.add(req.req_id)
            self._run(outputs, open_ids)
        except BaseException:
            self._abort(sorted(open_ids))
            raise
        return list(outputs.values())

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[CompletionOutput]:
        """`generate` over conversations in OpenAI's message format (one conversation, or a list
        of them), rendered by the model's chat template as the server renders
        /v1/chat/completions (`chat_template_kwargs`, e.g. {"enable_thinking": False}; `tools`
        in OpenAI's format). The text is what the model wrote, thinking and tool-call markup
        included (vLLM's LLM.chat too); text parts only. A conversation the template or the
        message format refuses raises ValueError."""
        from pydantic import TypeAdapter

        from appliance.server.errors import APIError
        from appliance.server.prompts import PromptBuilder
        from appliance.server.protocol import ChatMessage

        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        read = TypeAdapter(list[ChatMessage])
        builder = PromptBuilder(self.tokenizer.hf, self.scheduler.max_model_len)
        prompts: list[str | list[int]] = []
        for i, conversation in enumerate(conversations):
            try:
                parsed = read.validate_python(conversation)
                prompt = builder.chat(parsed, tools, chat_template_kwargs, add_generation_prompt)
            except APIError as exc:
                where = "" if single else f"conversation {i}: "
                raise ValueError(f"{where}{exc.message}") from None
            prompts.append(prompt.token_ids)
        return self.generate(prompts, sampling_params)

    def _run(self, outputs: dict[str, CompletionOutput], open_ids: set[str]) -> None:
        while open_ids:
            ran = self.engine.step()
            routed = self.engine.take_output()
            if routed is None:
                if not ran:
                    break
                continue
            deltas, finishes = self.detokenizer.process(routed)
            for finish in finishes:
                self.engine.finish(finish.req_id, finish.reason)
            for delta in deltas.deltas:
                if delta.req_id not in open_ids:
                    continue  # a request an earlier, interrupted call dropped
                if delta.finish_reason is not None:
                    open_ids.discard(delta.req_id)
                self._apply(delta, outputs[delta.req_id])

    def _abort(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.engine.abort(req_id)
        routed = self.engine.take_output()
        if routed is not None:
            self.detokenizer.process(routed)

    @staticmethod
    def _apply(delta: TextDelta, out: CompletionOutput) -> None:
        if delta.finish_reason == "error":
            raise ValueError(delta.error or "the request was refused")
        out.token_ids += delta.token_ids
        out.text += delta.text
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = [entry.logprob for entry in delta.prompt_logprobs]
        if out.logprobs is not None and delta.logprobs is not None:
            out.logprobs += [entry.logprob for entry in delta.logprobs]
        out.finish_reason = delta.finish_reason
