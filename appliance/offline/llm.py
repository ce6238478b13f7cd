"""Offline, in-process generation API (vLLM style): `LLM(model).generate(prompts,
SamplingParams())`, `model` a folder or a Hub id.

The served path without sockets: the router's engine loop (router/engine.py) drives the model
runner in this process (TP=1) or worker processes (TP>1, offline/workers.py), and the served
detokenizer turns tokens into text, so stop ids, stop strings and lengths end a request exactly as
they do behind the HTTP server.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, NoReturn

from appliance.beam_search import BeamSearchParams
from appliance.detokenizer.detokenizer import Detokenizer
from appliance.detokenizer.tokenizer import TextTokenizer
from appliance.generation_defaults import generation_defaults
from appliance.messages import (
    ImageInput,
    ProfileAction,
    ProfileAnswer,
    TextDelta,
    TokenizedRequest,
    TokenUpdate,
)
from appliance.offline.beams import BeamSearchOutput, beam_search
from appliance.offline.guides import GuideChecker, structured
from appliance.offline.images import OfflineImages, reserve_vit
from appliance.offline.options import build_engine_config, read_priorities, vllm_keywords
from appliance.offline.outputs import CompletionOutput, logprob_dicts
from appliance.offline.prompts import OfflinePrompt, read_conversation, read_prompt, render_chat
from appliance.parsers.reasoning import THINK_END, THINK_START, marker_id
from appliance.router.engine import EngineCore
from appliance.router.scheduler import Scheduler
from appliance.sampling_params import SamplingParams
from appliance.stop_reasons import stop_reason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["LLM", "CompletionOutput", "build_engine_config"]


def _no_pooling(name: str) -> Callable[..., NoReturn]:
    """vLLM's pooling entry points: this appliance serves generative models only."""

    def refuse(self, *args, **kwargs) -> NoReturn:
        raise NotImplementedError(
            f"LLM.{name}: pooling (encode, embed, classify, score, reward) is not supported; "
            "this appliance serves generative models (generate, chat)"
        )

    refuse.__name__ = name
    return refuse


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
        # vLLM's image resize range (min_pixels / max_pixels / size) for every image prompt
        self.mm_processor_kwargs = options.pop("mm_processor_kwargs", None)
        tp = vllm_keywords(options, tp, model)
        # False: a vision checkpoint's prompts take no images and no ViT is loaded (vLLM's
        # language_model_only / limit_mm_per_prompt={"image": 0} say the same)
        self.vision = bool(options.pop("vision", True))
        rng_seed = options.get("seed")  # vLLM's seed: unseeded requests sample reproducibly too
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
        vit, reserved = reserve_vit(str(self.model_dir), self.config, self.vision)
        if tp == 1:
            self.runner = ModelRunner(self.config, reserved_bytes=reserved)
            info = self.runner.info()
        else:
            from appliance.offline.workers import WorkerGroup

            self.runner = WorkerGroup(self.config, reserved_bytes=reserved)
            info = self.runner.info
        self.eos_token_ids = tuple(info.eos_token_ids)
        self.tokenizer = TextTokenizer.from_pretrained(self.model_dir)
        self.scheduler = Scheduler(
            self.config.scheduler,
            info.num_kv_slots,
            info.max_model_len,
            num_snapshot_slots=info.num_snapshot_slots,
            linear_state=info.linear_state,
            mtp_verify_max_bs=info.mtp_verify_max_bs,
            mtp_verify_costs=info.mtp_verify_costs,
            rng_seed=rng_seed,
        )
        self.engine = EngineCore(self.scheduler, list(self.eos_token_ids), self.runner)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._ids = itertools.count()
        self._guides = GuideChecker(str(self.model_dir), list(self.eos_token_ids))
        self._images: OfflineImages | None = None  # image prompts: made on the first one
        if vit is not None:  # loaded up front (CUDA) to reserve its memory
            self._images = OfflineImages(
                str(self.model_dir), self.config, self.runner, tp, True, vit
            )

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams (the generation_config defaults)."""
        return SamplingParams(**self.sampling_defaults)

    get_default_sampling_params = default_sampling_params  # vLLM's name

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's Hugging Face tokenizer (vLLM's get_tokenizer)."""
        return self.tokenizer.hf

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (vLLM's LLM.reset_prefix_cache; between generate calls no
        request holds an entry, so everything goes). False when prefix caching is off."""
        return self.scheduler.reset_prefix_cache() is not None

    def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        output_dir: str | None = None,
        activities: list[str] | None = None,
        num_steps: int | None = None,
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> str:
        """vLLM's LLM.start_profile: torch.profiler on every worker rank from the next step on,
        until `stop_profile` (or `num_steps` device steps). Traces go to `output_dir`, else
        APPLIANCE_TORCH_PROFILER_DIR, else <tmp>/appliance-profiles, one per rank
        (`<prefix>-<id>-TP-<rank>.trace.json.gz`); `activities` of CPU, GPU (default both), MEM.
        Returns the folder; ValueError for a bad argument, RuntimeError when already profiling."""
        from appliance.server.errors import APIError
        from appliance.server.profiling import StartProfileRequest, start_action

        try:
            body = StartProfileRequest(
                output_dir=output_dir,
                activities=activities,
                num_steps=num_steps,
                record_shapes=record_shapes,
                with_stack=with_stack,
                profile_prefix=profile_prefix,
            )
            action = start_action(body)
        except (APIError, ValueError) as exc:  # (pydantic's ValidationError is a ValueError)
            raise ValueError(f"start_profile: {exc}") from None
        self._profile(action)
        return action.output_dir

    def stop_profile(self) -> list[str]:
        """vLLM's LLM.stop_profile: stops the profiler, writes the traces; their paths."""
        return self._profile(ProfileAction(start=False)).files

    def _profile(self, action: ProfileAction) -> ProfileAnswer:
        self.engine.profile(0, action)
        while not (answers := self.engine.take_profile_answers()):
            self.engine.step()  # the switch rides in the next plan (an empty one here)
        if not answers[0].ok:
            raise RuntimeError(f"profiling: {answers[0].message}")
        return answers[0]

    encode = _no_pooling("encode")
    embed = _no_pooling("embed")
    classify = _no_pooling("classify")
    score = _no_pooling("score")
    reward = _no_pooling("reward")

    def close(self) -> None:
        """Frees image embeddings still held and stops the worker processes (tp > 1)."""
        if self._images is not None:
            self._images.release_all()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def images(self) -> OfflineImages:
        """The image side (preprocessing, the ViT, embedding entries), made on first use."""
        if self._images is None:
            tp = self.config.parallel.tp
            self._images = OfflineImages(
                str(self.model_dir), self.config, self.runner, tp, self.vision
            )
        return self._images

    def _truncated(self, prompt: OfflinePrompt, keep: int | None) -> OfflinePrompt:
        """SamplingParams.truncate_prompt_tokens (vLLM's): the prompt's last `keep` tokens, by
        the server's rule (server/prompts.py kept_tokens, keep_last): -1 the context length, past
        it or through an image a ValueError."""
        from appliance.server.errors import APIError
        from appliance.server.prompts import keep_last, kept_tokens

        try:
            keep = kept_tokens(keep, self.scheduler.max_model_len)
            cut = keep_last(prompt.token_ids, keep, prompt.offsets)
        except APIError as exc:
            raise ValueError(exc.message) from None
        if not cut:
            return prompt
        offsets = [offset - cut for offset in prompt.offsets]
        return replace(prompt, token_ids=prompt.token_ids[cut:], offsets=offsets)

    def _request(
        self,
        prompt: OfflinePrompt,
        params: SamplingParams,
        choice: int,
        fit: bool = False,
        priority: int = 0,
    ) -> TokenizedRequest:
        """Choice `choice` of the prompt's n: a given seed is offset so the choices differ (as the
        server's choices). `fit`: max_tokens is the generation config's cap (max_new_tokens),
        not asked for, so it shrinks to the room the prompt leaves (as the server's does);
        max_tokens None (vLLM's) is that room."""
        if params.guide is not None:
            self._guides.check(params.guide)
        ids = prompt.token_ids
        room = max(1, self.scheduler.max_model_len - len(ids))  # none left: the scheduler refuses
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if fit:
            max_tokens = min(max_tokens, room)
        req_id = f"offline-{next(self._ids)}"
        mm: list[ImageInput] = []
        if prompt.images:  # held for this request until it ends
            mm = self.images().inputs(prompt.images, prompt.offsets, req_id)
        return TokenizedRequest(
            req_id=req_id,
            prompt_token_ids=ids,
            mm=mm,
            sampling=params.choice_options(choice),
            max_tokens=max_tokens,
            ignore_eos=params.ignore_eos,
            stop_token_ids=list(params.stop_token_ids),
            detok=params.to_detok(),
            priority=priority,
            cache_salt=prompt.cache_salt,
            repetition=params.repetition_check(),
        )

    def generate(
        self,
        prompts: str | list[int] | dict | list[str | list[int] | dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[CompletionOutput]:
        """Runs every prompt to its end; one output a prompt, its first choice, holding its `n`
        choices (SamplingParams.n) as `outputs`, as vLLM's RequestOutput. A prompt is text, token
        ids or vLLM's prompt dict, images in its `multi_modal_data` (offline/prompts.py). A prompt
        the scheduler refuses raises its error (a ValueError, or QueueFull); any error or
        interrupt (KeyboardInterrupt) drops every request of the call and frees its images, so
        the LLM serves the next call as new. `use_tqdm` is taken for vLLM's scripts; no
        progress bar is drawn. `priority` (vLLM's): one value a prompt, lower admitted first;
        only with scheduling_policy="priority"."""
        del use_tqdm
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or self.default_sampling_params()
        fit = sampling_params is None and "max_tokens" in self.sampling_defaults
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(
                f"sampling_params: {len(params)} given for {len(prompts)} prompts (give one, or "
                "one a prompt)"
            )
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        priorities = read_priorities(
            priority, len(prompts), self.config.scheduler.scheduling_policy
        )
        checked: dict[int, SamplingParams] = {}
        for sp in params_list:
            if id(sp) not in checked:
                sp.check_vocabulary(len(self.tokenizer.hf))
                encode = functools.partial(self.tokenizer.hf.encode, add_special_tokens=False)
                hf = self.tokenizer.hf
                markers = marker_id(hf, THINK_START), marker_id(hf, THINK_END)
                checked[id(sp)] = (
                    structured(sp).tokenize_bad_words(encode).with_reasoning_tokens(*markers)
                )
        params_list = [checked[id(sp)] for sp in params_list]
        outputs: dict[str, tuple[CompletionOutput, SamplingParams]] = {}
        open_ids: set[str] = set()
        try:
            for index, (prompt, sp) in enumerate(zip(prompts, params_list)):
                if not isinstance(prompt, OfflinePrompt):
                    prompt = read_prompt(
                        self.tokenizer, self.images, prompt, index, self.mm_processor_kwargs
                    )
                prompt = self._truncated(prompt, sp.truncate_prompt_tokens)
                choices: list[CompletionOutput] = []
                for choice in range(sp.n):
                    req = self._request(prompt, sp, choice, fit, priorities[index])
                    outputs[req.req_id] = (None, sp)  # its images are held: freed at the end
                    self.engine.enqueue(req)
                    out = CompletionOutput(
                        prompt_token_ids=req.prompt_token_ids,
                        logprobs=[] if sp.logprobs is not None else None,
                        index=choice,
                        prompt=prompt.text,
                        request_id=req.req_id,
                        outputs=choices,
                    )
                    outputs[req.req_id] = (out, sp)
                    choices.append(out)
                    open_ids.add(req.req_id)
            if self._images is not None:
                self._images.encode_pending()  # every image of the call, batched, before it runs
            self._run(outputs, open_ids)
        except BaseException:
            self._abort(sorted(open_ids))
            raise
        finally:
            if self._images is not None and self._images.num_entries:
                self._release_images(list(outputs))
        return [out for out, _ in outputs.values() if out.index == 0]

    def _release_images(self, req_ids: list[str]) -> None:
        """The call's requests have ended or were dropped: once no step that may still load
        their embeddings is in flight, the entries they held are freed. Every entry is freed
        even when the engine fails while draining (workers that failed read nothing more)."""
        try:
            while self.engine.has_work() and not self.scheduler.has_work():
                self.engine.step()  # collects the steps in flight; plans nothing new
        finally:
            self.engine.take_ended_images()
            self._images.release(req_ids)

    def beam_search(
        self,
        prompts: str | list[int] | dict | list[str | list[int] | dict],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (offline/beams.py): per prompt its `params.beam_width` best
        sequences, best first."""
        del use_tqdm
        return beam_search(self, prompts, params)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,  # vLLM's next positional is lora_request: the rest by name
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[CompletionOutput]:
        """`generate` over conversations in OpenAI's message format (one conversation, or a list
        of them), rendered by the model's chat template (or `chat_template`) as the server renders
        /v1/chat/completions (`chat_template_kwargs`, e.g. {"enable_thinking": False}; `tools`
        in OpenAI's format; vLLM's `continue_final_message`). The text is what the model wrote,
        thinking and tool-call markup included (vLLM's LLM.chat too). Image parts: OpenAI's
        image_url (a data: URI, or an http(s) URL fetched as the server fetches it) and vLLM's
        {"type": "image_pil", "image_pil": img}, resized by `mm_processor_kwargs` (over the
        LLM's). A conversation the template, the message format or an image refuses raises
        ValueError naming it."""
        from functools import partial

        from appliance.server.errors import APIError
        from appliance.server.prompts import PromptBuilder

        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        builder = PromptBuilder(self.tokenizer.hf, self.scheduler.max_model_len)
        kwargs = dict(chat_template_kwargs or {})
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        mm_kwargs = mm_processor_kwargs or self.mm_processor_kwargs
        prompts: list[OfflinePrompt] = []
        for i, conversation in enumerate(conversations):
            where = "messages" if single else f"conversation {i}"
            render = partial(
                render_chat, builder, tools, kwargs, add_generation_prompt, continue_final_message
            )
            try:
                prompt = read_conversation(
                    builder, self.images, conversation, where, render, mm_kwargs
                )
            except APIError as exc:
                where = "" if single else f"conversation {i}: "
                raise ValueError(f"{where}{exc.message}") from None
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(
        self, outputs: dict[str, tuple[CompletionOutput, SamplingParams]], open_ids: set[str]
    ) -> None:
        while open_ids:
            ran = self.engine.step()
            routed = self.engine.take_output()
            if routed is None:
                if not ran:
                    break
                continue
            ended = self.engine.take_ended_images()  # as the router's ReleaseImages
            if ended and self._images is not None:
                self._images.release(ended)
            updates = {update.req_id: update for update in routed.updates}
            deltas, finishes = self.detokenizer.process(routed)
            for finish in finishes:
                self.engine.finish(finish.req_id, finish.reason)
            for delta in deltas.deltas:
                if delta.req_id not in open_ids:
                    continue  # a request an earlier, interrupted call dropped
                if delta.finish_reason is not None:
                    open_ids.discard(delta.req_id)
                out, params = outputs[delta.req_id]
                self._apply(delta, updates.get(delta.req_id), out, params)

    def _abort(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.engine.abort(req_id)
        routed = self.engine.take_output()
        if routed is not None:
            self.detokenizer.process(routed)

    def _apply(
        self,
        delta: TextDelta,
        update: TokenUpdate | None,
        out: CompletionOutput,
        params: SamplingParams,
    ) -> None:
        if delta.finish_reason == "error":
            raise ValueError(delta.error or "the request was refused")
        out.token_ids += delta.token_ids
        out.text += delta.text
        if delta.prompt_logprobs is not None and update is not None:
            scores = update.prompt_logprobs
            out.prompt_logprobs = logprob_dicts(delta.prompt_logprobs, scores.token_ids, scores.top)
        if out.logprobs is not None and delta.logprobs is not None and update is not None:
            tops = update.top_logprobs
            out.logprobs += logprob_dicts(delta.logprobs, delta.token_ids, tops)
        out.finish_reason = delta.finish_reason
        out.stop_reason = stop_reason(
            out.finish_reason,
            out.token_ids,
            out.text,
            lambda: self.tokenizer.decode(out.token_ids, params.skip_special_tokens),
            params.stop_token_ids,
            params.stop,
        )
