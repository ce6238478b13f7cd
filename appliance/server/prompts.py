"""Prompt building for the server: chat template rendering, tokenization and the length guards.

Called by the endpoints (serving_chat.py, serving_completion.py; in a worker thread, so the event
loop stays free) and by the skeleton (serving.py, for max_tokens). The checkpoint's own tokenizer
and chat template are used (transformers AutoTokenizer).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from appliance.messages import ImageData
from appliance.server.errors import BadRequest, ContextLengthExceeded
from appliance.server.images import NOT_SUPPORTED, RequestImage, expand_image_tokens
from appliance.server.protocol import ChatMessage, ImagePart

# max_prompt_chars = 0 means max_model_len x this: twice the characters of a full context of
# English text (~4 per token), and ~4 s of tokenizing for a 256k context on one core
CHARS_PER_TOKEN_LIMIT = 8
DOCUMENT_SEPARATOR = "<|endoftext|>"  # Qwen's end of a pretraining document (it has no BOS)
IM_START = "<|im_start|>"  # ChatML turn opener; the last one in a chat prompt opens the reply


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # rendered prompt text (None for token-id prompts)
    images: list[ImageData] = field(default_factory=list)  # with offsets into the expanded ids
    turn_start: int = -1  # chat: index of the generation prompt's <|im_start|> (-1: none)


def context_error(max_model_len: int, num_tokens: int, param: str) -> ContextLengthExceeded:
    return ContextLengthExceeded(
        f"This model's maximum context length is {max_model_len} tokens. However, your request "
        f"has {num_tokens} input tokens. Please reduce the length of the input messages.",
        param,
    )


def max_tokens_error(max_tokens: int, max_model_len: int, num_prompt: int) -> BadRequest:
    return BadRequest(
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
        f"maximum context length is {max_model_len} tokens and your request has {num_prompt} input "
        f"tokens ({max_tokens} > {max_model_len} - {num_prompt}).",
        "max_tokens",
        "context_length_exceeded",
    )


def kept_tokens(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """vLLM's `truncate_prompt_tokens`: how many of the prompt's last tokens to keep (-1: the
    context length); None keeps the whole prompt. 400 for another value or one past the context,
    in vLLM's words. The server's routes and the offline LLM read it alike."""
    value = truncate_prompt_tokens
    if value is None:
        return None
    if value == -1:
        return max_model_len
    if value < 1:
        raise BadRequest(
            f"truncate_prompt_tokens: must be -1 (the context length) or at least 1, got {value}.",
            "truncate_prompt_tokens",
        )
    if value > max_model_len:
        raise BadRequest(
            f"truncate_prompt_tokens: {value} is greater than max_model_len ({max_model_len}); "
            "select a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    return value


def keep_last(ids: Sequence[int], keep: int | None, offsets: Sequence[int] = ()) -> int:
    """How many leading tokens to cut so that the last `keep` stay (0: none). A cut through an
    image (its tokens start at one of `offsets`) is a 400: the model cannot see a part of an
    image (send fewer images, or a larger truncate_prompt_tokens)."""
    if keep is None or len(ids) <= keep:
        return 0
    cut = len(ids) - keep
    for i, offset in enumerate(offsets):
        if offset < cut:
            raise BadRequest(
                f"truncate_prompt_tokens: keeping the last {keep} of the prompt's {len(ids)} "
                f"tokens would cut image {i} (its tokens start at {offset}).",
                "truncate_prompt_tokens",
            )
    return cut


class PromptBuilder:
    """Owns the HF tokenizer for the server; every check that needs the context length is here."""

    def __init__(self, tokenizer: Any, max_model_len: int = 0, max_prompt_chars: int = 0) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._max_prompt_chars = max_prompt_chars

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, added tokens included: ids in [0, vocab_size)."""
        return len(self.tokenizer)

    @property
    def max_prompt_chars(self) -> int:
        return self._max_prompt_chars or CHARS_PER_TOKEN_LIMIT * self.max_model_len

    def check_chars(self, num_chars: int, param: str) -> None:
        limit = self.max_prompt_chars
        if limit and num_chars > limit:
            err = ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {num_chars} input characters, more than the {limit} characters "
                "this server tokenizes. Please reduce the length of the input messages.",
                param,
            )
            raise err

    def check_tokens(self, num_tokens: int, param: str) -> None:
        if num_tokens == 0:
            raise BadRequest(f"{param}: the prompt is empty.", param)
        if num_tokens >= self.max_model_len:
            raise context_error(self.max_model_len, num_tokens, param)

    def max_tokens_for(self, requested: int | None, num_prompt: int) -> int:
        """The generation cap: the requested max_tokens, or all the context the prompt leaves."""
        room = self.max_model_len - num_prompt
        if requested is None:
            return room
        if requested > room:
            raise max_tokens_error(requested, self.max_model_len, num_prompt)
        return requested

    def _keep_last(
        self, ids: list[int], keep: int | None, images: Sequence[ImageData] = ()
    ) -> tuple[list[int], list[ImageData]] | None:
        """The prompt's last `keep` tokens and its images' offsets moved with them, or None when
        nothing is cut (keep_last's rule)."""
        cut = keep_last(ids, keep, [image.offset for image in images])
        if not cut:
            return None
        moved = [msgspec.structs.replace(image, offset=image.offset - cut) for image in images]
        return ids[cut:], moved

    # ------------------------------------------------------------------ chat
    def chat(
        self,
        messages: list[ChatMessage],
        tools: list[dict] | None,
        template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool = True,
        images: Sequence[RequestImage] = (),
        image_token_id: int | None = None,
        continue_final_message: bool = False,
        keep: int | None = None,
    ) -> Prompt:
        """Renders and tokenizes; `images` (checked by appliance/server/images.py, in message
        order) each expand their one `<|image_pad|>` to their token count.
        `continue_final_message` (vLLM's): the last, assistant message is left open for the model
        to go on with (no end of turn, no new generation prompt). `keep` (kept_tokens()): only
        the rendered prompt's last `keep` tokens are sent, and `text` is theirs."""
        if continue_final_message and add_generation_prompt:
            raise BadRequest(
                "continue_final_message: set add_generation_prompt to false with it (the last "
                "message is continued, no new turn is opened).",
                "continue_final_message",
            )
        if continue_final_message and messages[-1].role != "assistant":
            raise BadRequest(
                "continue_final_message: the last message must be the assistant's, to continue.",
                "continue_final_message",
            )
        rendered_messages = [_message_dict(m, bool(images)) for m in messages]
        self.check_chars(message_chars(messages), "messages")
        kwargs = dict(template_kwargs or {})
        if not kwargs.get("chat_template") and not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(
                "This model has no chat template (none in its tokenizer_config.json or "
                "chat_template.jinja), so it cannot render messages: use /v1/completions."
            )
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                rendered_messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **({"continue_final_message": True} if continue_final_message else {}),
                **kwargs,
            )
        except Exception as exc:  # jinja raise_exception() and template errors are user errors
            raise BadRequest(
                f"messages: the chat template rejected the conversation: {exc}", "messages"
            ) from exc
        ids = self._encode(text, "messages")
        data: list[ImageData] = []
        if images:
            _check_no_typed_placeholder(
                messages, self.tokenizer.convert_ids_to_tokens(image_token_id)
            )
            ids, data = expand_image_tokens(ids, image_token_id, images)
        if kept := self._keep_last(ids, keep, data):
            (ids, data), text = kept, self.decode(kept[0])
        self.check_tokens(len(ids), "messages")
        opened = add_generation_prompt or continue_final_message  # the turn being generated
        return Prompt(ids, text, data, self._turn_start(ids) if opened else -1)

    def _turn_start(self, ids: list[int]) -> int:
        """Index of the last `<|im_start|>` (ChatML: the generation prompt's), or -1."""
        marker = self._im_start_id
        if marker is None:
            return -1
        return next((i for i in range(len(ids) - 1, -1, -1) if ids[i] == marker), -1)

    @functools.cached_property
    def _im_start_id(self) -> int | None:
        marker = self.tokenizer.convert_tokens_to_ids(IM_START)
        if isinstance(marker, int) and self.tokenizer.convert_ids_to_tokens(marker) == IM_START:
            return marker
        return None

    # ------------------------------------------------------------------ completions
    def completion(
        self,
        prompt: str | list[int],
        keep: int | None = None,
        images: Sequence[RequestImage] = (),
        image_token_id: int | None = None,
        where: tuple[str, str, str] = ("prompt", "the prompt has", ""),
    ) -> Prompt:
        """A text or token-id prompt; `keep` (kept_tokens()): only its last `keep` tokens are sent
        (and echoed: `text` is theirs). `images` (SGLang's /generate image_data, loaded by
        images.py) each expand one `<|image_pad|>` of the prompt to their token count; `where`
        words a count mismatch (expand_image_tokens)."""
        if isinstance(prompt, str):
            self.check_chars(len(prompt), "prompt")
            ids = self._encode(prompt, "prompt") or self.start_ids("prompt")
        else:
            vocab = self.vocab_size
            bad = [t for t in prompt if t < 0 or t >= vocab]
            if bad:
                raise BadRequest(
                    f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab}).", "prompt"
                )
            ids = list(prompt)
        data: list[ImageData] = []
        if images or image_token_id is not None:
            ids, data = expand_image_tokens(ids, image_token_id, images, where)
        text = prompt if isinstance(prompt, str) else None  # as sent: one pad per image
        if kept := self._keep_last(ids, keep, data):
            (ids, data), text = kept, None if text is None else self.decode(kept[0])
        self.check_tokens(len(ids), "prompt")
        return Prompt(ids, text, data)

    def start_ids(self, param: str) -> list[int]:
        """What an empty text prompt (which OpenAI accepts) becomes: the BOS token, or, for
        tokenizers without one (Qwen), `<|endoftext|>`, the separator every pretraining document
        follows, so the model generates as at the start of a document."""
        tokenizer = self.tokenizer
        if tokenizer.bos_token_id is not None:
            return [tokenizer.bos_token_id]
        separator = tokenizer.convert_tokens_to_ids(DOCUMENT_SEPARATOR)
        # An unknown token converts to the unk id (Qwen's unk token is <|endoftext|> itself).
        if isinstance(separator, int) and (
            tokenizer.convert_ids_to_tokens(separator) == DOCUMENT_SEPARATOR
        ):
            return [separator]
        raise BadRequest(
            f"{param}: the prompt is empty, and this model's tokenizer has neither a BOS token "
            f"nor {DOCUMENT_SEPARATOR} to start generating from.",
            param,
        )

    def _encode(self, text: str, param: str) -> list[int]:
        """Token ids of `text`; text that is not valid Unicode (a lone UTF-16 surrogate from a
        JSON escape such as "\\ud800") is a client error, not a tokenizer crash."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(
                f"{param}: the text is not valid Unicode ({exc.reason} at character {exc.start}).",
                param,
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_words(self, text: str) -> list[int]:
        """Token ids of a word of `bad_words` (a 400 naming it for text that is not Unicode)."""
        return self._encode(text, "bad_words")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def message_chars(messages: list[ChatMessage]) -> int:
    """The text characters of a conversation (what `check_chars` limits), images left out."""
    return sum(_text_chars(m.content) for m in messages)


def _check_no_typed_placeholder(messages: list[ChatMessage], placeholder: str) -> None:
    """The image placeholder token typed as text would take an image's place (or be counted as
    one): refused, naming the message, when the request has images."""
    for index, message in enumerate(messages):
        content = message.content
        parts = content if isinstance(content, list) else [content or ""]
        texts = [p if isinstance(p, str) else getattr(p, "text", "") for p in parts]
        if any(placeholder in text for text in texts):
            raise BadRequest(
                f"messages.{index}.content: contains {placeholder}, the image placeholder "
                "token, as text; it may not appear in a request with images.",
                "messages",
            )


def _text_chars(content: str | list | None) -> int:
    if isinstance(content, list):
        return sum(len(p.text) for p in content if not isinstance(p, ImagePart))
    return len(content or "")


def _message_dict(message: ChatMessage, with_images: bool = False) -> dict[str, Any]:
    """A message as the chat template expects it: text parts joined into one string, or, when it
    has images, a list of {"type": "text"} / {"type": "image"} parts (the Qwen templates emit
    one <|vision_start|><|image_pad|><|vision_end|> per image part). OpenAI's `developer` role
    is its newer name for `system` (the SDKs send it), which Qwen's templates know."""
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    content = message.content
    if isinstance(content, list):
        if any(isinstance(p, ImagePart) for p in content):
            if not with_images:  # images were not loaded: this server takes none
                raise BadRequest(NOT_SUPPORTED, "messages")
            content = [
                {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in content
            ]
        else:
            content = "\n".join(p.text for p in content)
    out["content"] = content if content is not None else ""
    for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    if message.tool_calls:
        out["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI clients send `function.arguments` as a JSON string; Qwen templates iterate over
    the arguments as a mapping (`<parameter=K>V</parameter>`), so a JSON object string is parsed.
    Anything else (not JSON, not an object) is passed through for the template to render as is."""
    function = call.get("function")
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}
