"""The offline `LLM`'s prompts as token ids and images: text, token ids, vLLM's prompt dicts (with
`multi_modal_data` images) and chat conversations (OpenAI image parts, vLLM's `image_pil`),
rendered as the server renders /v1/chat/completions. Called by offline/llm.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.offline.images import OfflineImages, PromptImage

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # Qwen-VL's image slot, per image
PROMPT_KEYS = (
    "prompt",
    "prompt_token_ids",
    "multi_modal_data",
    "mm_processor_kwargs",
    "cache_salt",
)
_PIL_URL = "offline-pil:"  # an image_pil part's stand-in url while the message is validated


@dataclass
class OfflinePrompt:
    """A prompt ready for the engine: its ids with every image expanded to its token count."""

    token_ids: list[int]
    text: str | None  # the prompt's text, when given as text (CompletionOutput.prompt)
    images: list[PromptImage] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each image's first <|image_pad|>
    cache_salt: str = ""  # vLLM's: cached prefixes shared only with prompts of the same salt


def token_ids(tokenizer: Any, prompt: str | list[int]) -> tuple[list[int], str | None]:
    """Text or token ids -> ids (checked against the vocabulary) and the text, if any."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), prompt
    ids = list(prompt)
    vocab = len(tokenizer.hf)
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt: token id {bad!r} is not in the vocabulary (0..{vocab - 1})")
    return ids, None


def read_prompt(
    tokenizer: Any,
    images: Callable[[], OfflineImages],
    prompt: str | list[int] | dict,
    index: int,
    mm_kwargs: dict | None,
) -> OfflinePrompt:
    """A string, token ids, or vLLM's TextPrompt {"prompt": ...} / TokensPrompt
    {"prompt_token_ids": [...]}, either with {"multi_modal_data": {"image": one or a list}} (a
    PIL.Image or an image file's bytes each; the prompt holds one `<|image_pad|>`, as a
    PLACEHOLDER, per image) and `mm_processor_kwargs` (over the LLM's), and `cache_salt`."""
    if not isinstance(prompt, dict):
        return OfflinePrompt(*token_ids(tokenizer, prompt))
    extra = sorted(set(prompt) - set(PROMPT_KEYS))
    if extra or not ({"prompt", "prompt_token_ids"} & set(prompt)):
        raise ValueError(
            f"prompt: {', '.join(extra) or 'a dict without a prompt'} is not supported: a prompt "
            "dict holds 'prompt' (text) or 'prompt_token_ids', and may hold 'multi_modal_data', "
            "'mm_processor_kwargs' and 'cache_salt'"
        )
    salt = prompt.get("cache_salt", "")
    if "cache_salt" in prompt and (not isinstance(salt, str) or not salt):
        raise ValueError(f"prompt {index}: cache_salt must be a non-empty string, got {salt!r}")
    if "prompt_token_ids" in prompt:
        ids = token_ids(tokenizer, prompt["prompt_token_ids"])[0]
        text = prompt.get("prompt")
    else:
        ids, text = token_ids(tokenizer, prompt["prompt"])
    data = prompt.get("multi_modal_data")
    if not data:
        return OfflinePrompt(ids, text, cache_salt=salt)
    where = f"prompt {index}"
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise ValueError(f"{where}: multi_modal_data.{unknown[0]} is not supported (only image)")
    sources = data["image"] if isinstance(data["image"], list | tuple) else [data["image"]]
    store = images()
    store.check_enabled(where)
    config = store.preprocess_config(prompt.get("mm_processor_kwargs", mm_kwargs), where)
    loaded = [store.load(s, config, f"{where}: image {i}") for i, s in enumerate(sources)]
    expanded, offsets = expand(ids, store.image_token_id, loaded, where)
    return OfflinePrompt(expanded, text, loaded, offsets, salt)


def expand(
    ids: list[int], pad: int, images: list[PromptImage], where: str
) -> tuple[list[int], list[int]]:
    """Each image's one `<|image_pad|>` becomes its token count; returns the ids and offsets."""
    positions = [i for i, token in enumerate(ids) if token == pad]
    if len(positions) != len(images):
        raise ValueError(
            f"{where}: {len(positions)} image placeholders for {len(images)} images; write "
            f"{PLACEHOLDER} in the prompt once per image"
        )
    out: list[int] = []
    offsets: list[int] = []
    previous = 0
    for position, image in zip(positions, images):
        out += ids[previous:position]
        offsets.append(len(out))
        out += [pad] * image.num_tokens
        previous = position + 1
    return out + ids[previous:], offsets


def _with_pil_urls(conversation: list[dict]) -> tuple[list[dict], list[Any]]:
    """vLLM's {"type": "image_pil", "image_pil": img} parts as image_url parts with a stand-in
    url (the message schema knows OpenAI's parts only); the images, in order."""
    pils: list[Any] = []
    out = []
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "image_pil" for p in content
        ):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_pil":
                    parts.append(
                        {"type": "image_url", "image_url": {"url": f"{_PIL_URL}{len(pils)}"}}
                    )
                    pils.append(part.get("image_pil"))
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, pils


def read_conversation(
    builder: Any,
    images: Callable[[], OfflineImages],
    conversation: list[dict],
    where: str,
    render: Callable[..., Any],
    mm_kwargs: dict | None,
) -> OfflinePrompt:
    """A conversation rendered by `render(parsed, request_images, image_token_id)` (the server's
    PromptBuilder.chat, bound to the call's template options). Image parts: data: URIs, http(s)
    URLs (fetched as the server fetches them) and vLLM's image_pil."""
    from pydantic import TypeAdapter

    from appliance.server.images import RequestImage, image_parts
    from appliance.server.protocol import ChatMessage

    conversation, pils = _with_pil_urls(conversation)
    parsed = TypeAdapter(list[ChatMessage]).validate_python(conversation)
    parts = image_parts(parsed)
    if not parts:
        prompt = render(parsed, (), None)
        return OfflinePrompt(prompt.token_ids, None)
    store = images()
    store.check_enabled(where)
    config = store.preprocess_config(mm_kwargs, where)
    loaded = []
    for i, part in enumerate(parts):
        url, at = part.image_url.url, f"{where}: image {i}"
        if url.startswith(_PIL_URL):
            source = pils[int(url.removeprefix(_PIL_URL))]
        else:
            source = store.file_bytes(url, at)
        loaded.append(store.load(source, config, at))
    checked = [RequestImage(im.key, b"", im.grid_thw, im.num_tokens) for im in loaded]
    prompt = render(parsed, checked, store.image_token_id)
    return OfflinePrompt(prompt.token_ids, None, loaded, [d.offset for d in prompt.images])


def render_chat(
    builder: Any,
    tools: list[dict] | None,
    kwargs: dict,
    add_generation_prompt: bool,
    continue_final_message: bool,
    parsed: list[Any],
    images: Sequence[Any],
    image_token_id: int | None,
) -> Any:
    """PromptBuilder.chat (the server's rendering) with the call's template options bound by
    LLM.chat; `read_conversation` supplies the conversation and its checked images."""
    return builder.chat(
        parsed,
        tools,
        kwargs,
        add_generation_prompt,
        images,
        image_token_id,
        continue_final_message=continue_final_message,
    )
