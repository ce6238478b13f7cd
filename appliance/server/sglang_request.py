"""SGLang's native `/generate` request (its GenerateReqInput and sampling_params, in SGLang's names)
translated into the /v1/completions request the handler skeleton serves, and the 400s of that path
renamed back to the fields the client sent.

Used by serving_generate.py. What changes the output and cannot be honoured here is refused naming
the field; SGLang's bookkeeping fields (log_metrics, conversation_id, ...) are ignored, as are
fields SGLang itself does not know. `image_data` becomes one list of images per prompt, loaded and
expanded by serving_generate.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ConfigDict, Field, ValidationError

from appliance.sampling_params import MAX_LOGPROBS
from appliance.server.errors import APIError, BadRequest
from appliance.server.protocol import CompletionRequest, _Schema

_NO_DYNAMIC_PATCH = "dynamic patching is InternVL's; Qwen-VL images are resized to a grid"
SGLANG_MAX_NEW_TOKENS = 128  # SGLang's max_new_tokens when a request does not give one

# SGLang's GenerateReqInput fields this server does not serve -> why. Refused when set to anything
# but their default (null, false, 0, an empty list or dict, a list of nulls).
REFUSED = {
    "input_embeds": "embeddings as input are not supported; send text or input_ids",
    "video_data": "video input is not supported",
    "audio_data": "audio input is not supported",
    "mm_hashes": "image hashes are not taken; send the images in image_data",
    "mm_content_hashes": "image hashes are not taken; send the images in image_data",
    "use_audio_in_video": "audio input is not supported",
    "video_config": "video input is not supported",
    "token_ids_logprob": "logprobs of chosen token ids are not supported; use top_logprobs_num",
    "return_sampling_mask": "not supported",
    "return_flat_raw_top_logprobs": "not supported; top logprobs come as nested lists",
    "return_flat_raw_top_logprobs_b64": "not supported; top logprobs come as nested lists",
    "return_hidden_states": "hidden states are not returned",
    "return_routed_experts": "routed experts are not returned",
    "routed_experts_start_len": "routed experts are not returned",
    "return_indexer_topk": "not supported",
    "return_bytes": "not supported",
    "return_entropy": "not supported",
    "return_prompt_token_ids": "not supported",
    "session_params": "sessions are not supported; send the whole prompt",
    "lora_path": "LoRA adapters are not supported",
    "lora_id": "LoRA adapters are not supported",
    "custom_logit_processor": "custom logit processors are not supported; logit_bias is",
    "positional_embed_overrides": "embedding overrides are not supported",
    "bootstrap_host": "prefill-decode disaggregation is not supported",
    "bootstrap_port": "prefill-decode disaggregation is not supported",
    "bootstrap_room": "prefill-decode disaggregation is not supported",
    "bootstrap_pair_key": "prefill-decode disaggregation is not supported",
    "decode_tp_size": "prefill-decode disaggregation is not supported",
    "disagg_prefill_dp_rank": "prefill-decode disaggregation is not supported",
    "routed_dp_rank": "this server has one data-parallel rank, 0",
    "data_parallel_rank": "this server has one data-parallel rank, 0",
    "background": "background requests are not supported",
    "require_reasoning": "not supported; the chat template's enable_thinking decides reasoning",
    "max_thinking_tokens": "thinking budgets are not supported; bound max_new_tokens",
    "extra_key": "cache namespaces are not supported",
    "cache_salt": "cache namespaces are not supported",
    "multi_item_delimiter_indices": "multi-item scoring is not supported",
    "max_dynamic_patch": _NO_DYNAMIC_PATCH,
    "min_dynamic_patch": _NO_DYNAMIC_PATCH,
    "image_max_dynamic_patch": _NO_DYNAMIC_PATCH,
    "video_max_dynamic_patch": "video input is not supported",
    "images_config": "not supported; images are sized by the checkpoint's preprocessor config",
}
# SGLang's sampling_params keys this server does not serve -> why (any other unknown key is
# refused too: SGLang refuses keys its SamplingParams does not have)
REFUSED_SAMPLING = {
    "stop_regex": "regex stop conditions are not supported; use stop strings",
    "structural_tag": "structural tags are not supported; use regex, ebnf or json_schema",
    "custom_params": "custom logit processors are not supported",
    "stream_interval": "not supported; streamed chunks carry each decoded delta",
    "beam_width": "beam search is not supported",
}

# the completion request's fields that a 400 of the shared path names -> SGLang's sampling key
_SAMPLING_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
    **{
        name: name
        for name in (
            "temperature top_p top_k min_p presence_penalty frequency_penalty repetition_penalty"
            " stop stop_token_ids ignore_eos skip_special_tokens logit_bias n regex ebnf"
            " json_schema"
        ).split()
    },
}
_TOP_LEVEL_NAMES = {"logprobs": "top_logprobs_num", "prompt_logprobs": "logprob_start_len"}


class GenerateSampling(_Schema):
    """SGLang's sampling_params with its defaults; unknown keys stay (extra) to be refused."""

    model_config = ConfigDict(extra="allow", strict=True)

    max_new_tokens: int | None = Field(SGLANG_MAX_NEW_TOKENS, ge=0)  # null: the context's room
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # accepted either way: HF fast tokenizers (every Qwen checkpoint's) ignore it when decoding,
    # in SGLang too
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string (or stop token's text)
    n: int = Field(1, ge=1)
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None  # SGLang sends JSON text
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None


class GenerateRequest(_Schema):
    """SGLang's GenerateReqInput, the fields served here; the rest land in `model_extra`."""

    model_config = ConfigDict(extra="allow", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # one dict for every prompt, or a list of one per prompt (checked in `translate`)
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    # one value, or a list of one per prompt
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1  # -1: only the generated tokens' logprobs
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    # SGLang's: higher is admitted first (the router's priority is its negation); only with
    # --scheduling-policy priority (SGLang's --enable-priority-scheduling)
    priority: int | None = None
    # one prompt: an image or a list of them; a batch: one entry (null, an image or a list) per
    # prompt, or one image for every prompt. An image: http(s) URL, data: URI or bare base64
    image_data: str | list[str | list[str] | None] | None = None
    modalities: list[str] | None = None  # SGLang's hint ("image", "multi-images"); read as given


class SGLangCompletion(CompletionRequest):
    """The completions request a /generate body becomes, with what only /generate reads."""

    logprob_start_len: int = -1  # the first prompt position whose logprob is returned (-1: none)
    prompt_param: str = "text"  # the field the prompts came in: "text" | "input_ids"
    image_data: list[list[str]] = Field(default_factory=list)  # per prompt ([]: no images)


@dataclass(frozen=True)
class GenerateShape:
    """What the answer needs from the request besides its choices' deltas."""

    single: bool  # one prompt and n = 1: the answer is one object, else a list
    rids: list[str] | None  # meta_info.id per choice, from the client's rid (None: ours)
    return_logprob: bool
    top_logprobs_num: int  # alternatives per position (0: no *_top_logprobs lists)
    logprob_start_len: int  # -1: no prompt positions
    text_in_logprobs: bool  # the token's text as each entry's third item (else null)
    stops: list[str]  # stop strings: finish_reason.matched names the one that matched
    keep_stops: bool  # no_stop_trim: the text ends with the matched stop string
    skip_special_tokens: bool


def _is_set(value: Any) -> bool:
    """Whether a refused field asks for something: its defaults (null, false, 0, "", empty or
    all-null lists: SGLang's batch padding) ask for nothing."""
    if isinstance(value, list | tuple):
        return any(_is_set(v) for v in value)
    if isinstance(value, dict):
        return bool(value)
    return value is not None and value is not False and value != 0 and value != ""


def _refuse_unserved(extra: dict[str, Any], refused: dict[str, str], where: str = "") -> None:
    for name, value in extra.items():
        if name in refused and _is_set(value):
            raise BadRequest(f"{where}{name}: {refused[name]}.", (where or name).rstrip("."))


def _one(name: str, value: Any, num_prompts: int) -> Any:
    """A per-prompt field's one value: a list must give the same value for every prompt (one
    request carries one setting here)."""
    if not isinstance(value, list):
        return value
    if len(value) != num_prompts:
        raise BadRequest(
            f"{name}: a list gives one value per prompt ({num_prompts}), got {len(value)}.", name
        )
    if any(v != value[0] for v in value):
        raise BadRequest(
            f"{name}: per-prompt values that differ are not supported; send one request per "
            "setting.",
            name,
        )
    return value[0]


def _sampling(raw: dict[str, Any], where: tuple) -> GenerateSampling:
    """One sampling_params dict, its type errors worded as the body's (400 naming the key)."""
    try:
        sampling = GenerateSampling.model_validate(raw)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *where, *e["loc"])} for e in exc.errors()]
        raise RequestValidationError(errors) from None
    extra = {k: v for k, v in (sampling.model_extra or {}).items() if v is not None}
    _refuse_unserved(extra, REFUSED_SAMPLING, "sampling_params.")
    if extra:  # null is read as unset, as SGLang reads it for its own keys
        raise BadRequest(
            f"sampling_params.{next(iter(extra))}: not a sampling parameter SGLang or this "
            "server knows.",
            "sampling_params",
        )
    return sampling


def _prompts(body: GenerateRequest) -> tuple[str, str | list, int, bool]:
    """(field, prompts, how many, single) of a body's text or input_ids."""
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("Give either text or input_ids.", "text")
    field = "text" if body.text is not None else "input_ids"
    prompts = body.text if body.text is not None else body.input_ids
    if not prompts and not isinstance(prompts, str):
        raise BadRequest(f"{field}: expected a non-empty list.", field)
    single = isinstance(prompts, str) or isinstance(prompts[0], int)
    return field, prompts, 1 if single else len(prompts), single


def translate(body: GenerateRequest) -> tuple[SGLangCompletion, GenerateShape]:
    """The completion request of a /generate body and the shape of its answer; 400 naming the
    field for what is not served."""
    _refuse_unserved(body.model_extra or {}, REFUSED)
    field, prompts, num_prompts, single = _prompts(body)
    raw = body.sampling_params
    if isinstance(raw, list):
        if len(raw) != num_prompts:
            raise BadRequest(
                f"sampling_params: a list gives one dict per prompt ({num_prompts}), got "
                f"{len(raw)}.",
                "sampling_params",
            )
        settings = [_sampling(d, ("sampling_params", i)) for i, d in enumerate(raw)]
        _one("sampling_params", settings, num_prompts)
        sampling = settings[0]
    else:
        sampling = _sampling(raw or {}, ("sampling_params",))
    return_logprob = bool(_one("return_logprob", body.return_logprob, num_prompts))
    start = _one("logprob_start_len", body.logprob_start_len, num_prompts)
    top_k = _one("top_logprobs_num", body.top_logprobs_num, num_prompts)
    if return_logprob and start < -1:
        raise BadRequest(
            f"logprob_start_len: expected -1 or >= 0, got {start}.", "logprob_start_len"
        )
    if return_logprob and not 0 <= top_k <= MAX_LOGPROBS:
        raise BadRequest(
            f"top_logprobs_num: expected an integer in [0, {MAX_LOGPROBS}], got {top_k}.",
            "top_logprobs_num",
        )
    completion = SGLangCompletion(
        prompt=prompts,
        prompt_param=field,
        image_data=_images(body, num_prompts, single),
        max_tokens=sampling.max_new_tokens,
        min_tokens=sampling.min_new_tokens,
        # SGLang's defaults, not generation_config.json's: its /generate samples so too
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        repetition_penalty=sampling.repetition_penalty,
        seed=sampling.sampling_seed,
        stop=sampling.stop,
        stop_token_ids=sampling.stop_token_ids,
        ignore_eos=sampling.ignore_eos,
        skip_special_tokens=sampling.skip_special_tokens,
        include_stop_str_in_output=sampling.no_stop_trim,
        n=sampling.n,
        regex=sampling.regex,
        ebnf=sampling.ebnf,
        json_schema=sampling.json_schema,
        logit_bias=sampling.logit_bias,
        stream=body.stream,
        logprobs=top_k if return_logprob else None,
        # echo + logprobs is how the completions path scores the prompt, streamed or not (its
        # prompt_logprobs is refused with stream); the echoed text itself is never worded here
        echo=return_logprob and start >= 0,
        logprob_start_len=start if return_logprob else -1,
        priority=-(body.priority or 0),
    )
    shape = GenerateShape(
        single=single and sampling.n == 1,
        rids=_rids(body.rid, num_prompts, single) if sampling.n == 1 else None,
        return_logprob=return_logprob,
        top_logprobs_num=top_k,
        logprob_start_len=completion.logprob_start_len,
        text_in_logprobs=body.return_text_in_logprobs,
        stops=[sampling.stop] if isinstance(sampling.stop, str) else list(sampling.stop or []),
        keep_stops=sampling.no_stop_trim,
        skip_special_tokens=sampling.skip_special_tokens,
    )
    return completion, shape


def _images(body: GenerateRequest, num_prompts: int, single: bool) -> list[list[str]]:
    """image_data as one list of images per prompt (SGLang's reading of its shapes); [] when
    there are none."""
    data = body.image_data
    unknown = set(body.modalities or ()) - {"image", "multi-images"}
    if unknown:
        raise BadRequest(
            f'modalities: {sorted(unknown)[0]!r} is not served; images are ("image", '
            '"multi-images").',
            "modalities",
        )
    if not _is_set(data):
        return []
    if isinstance(data, str):
        return [[data] for _ in range(num_prompts)]
    if single:
        if any(isinstance(d, list) for d in data):
            raise BadRequest(
                "image_data: one prompt takes an image or a list of images, not nested lists.",
                "image_data",
            )
        return [[d for d in data if d]]
    if len(data) != num_prompts:
        raise BadRequest(
            f"image_data: a batch gives one entry per prompt ({num_prompts}), got {len(data)}.",
            "image_data",
        )
    return [[d for d in (entry if isinstance(entry, list) else [entry]) if d] for entry in data]


def _rids(rid: str | list[str] | None, num_prompts: int, single: bool) -> list[str] | None:
    """meta_info ids as SGLang gives them: the rid, `<rid>_<i>` in a batch, or the list's."""
    if rid is None:
        return None
    if isinstance(rid, str):
        return [rid] if single else [f"{rid}_{i}" for i in range(num_prompts)]
    if len(rid) != num_prompts:
        raise BadRequest(
            f"rid: a list gives one id per prompt ({num_prompts}), got {len(rid)}.", "rid"
        )
    return list(rid)


def renamed(err: APIError, prompt_param: str) -> APIError:
    """A 400 of the completions path, naming the /generate field the client sent."""
    if err.param == "prompt":
        err.param = prompt_param
        err.message = re.sub(r"^prompt:", f"{prompt_param}:", err.message)
    elif err.param in _TOP_LEVEL_NAMES:
        new = _TOP_LEVEL_NAMES[err.param]
        err.message = re.sub(rf"^{err.param}:", f"{new}:", err.message)
        err.param = new
    elif err.param in _SAMPLING_NAMES:
        new = f"sampling_params.{_SAMPLING_NAMES[err.param]}"
        message = err.message.replace("'max_tokens' or 'max_completion_tokens'", new)
        message = re.sub(rf"^{err.param}:", f"{new}:", message)
        message = re.sub(r"\bmax_tokens\b", "max_new_tokens", message)
        err.message = re.sub(r"\bmin_tokens\b", "min_new_tokens", message)
        err.param = "sampling_params"
    return err
