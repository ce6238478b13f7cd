"""Structured outputs of the offline `LLM`: vLLM's `structured_outputs` / `guided_decoding` made
into the guide the server makes of the same request field, and each guide checked to compile
before its request runs. Called by offline/llm.py."""

from __future__ import annotations

from dataclasses import replace

from appliance.messages import Guide
from appliance.sampling_params import SamplingParams


def structured(params: SamplingParams) -> SamplingParams:
    """vLLM's structured_outputs / guided_decoding (json, regex, choice, grammar or json_object;
    a dict or an object with those attributes) as the guide the server makes of the same request
    field; a bad one raises ValueError naming it."""
    name = "structured_outputs" if params.structured_outputs else "guided_decoding"
    spec = getattr(params, name)
    if not spec:
        return params
    from types import SimpleNamespace

    from appliance.server.errors import APIError
    from appliance.server.guides import _EXTRA_KEYS, request_guide

    if not isinstance(spec, dict):
        spec = {key: getattr(spec, key, None) for key in _EXTRA_KEYS}
    try:
        _, guide = request_guide(SimpleNamespace(structured_outputs=spec), None, None)
    except APIError as exc:
        message = exc.message.removeprefix("structured_outputs: ")
        raise ValueError(f"{name}: {message}") from None
    return replace(params, guide=guide, structured_outputs=None, guided_decoding=None)


class GuideChecker:
    """Compiles a guide once before its request reaches the workers (which compile it again,
    cached), so a grammar that does not compile is the caller's ValueError; xgrammar and the
    tokenizer load on the first guide."""

    def __init__(self, model_dir: str, eos_token_ids: list[int]) -> None:
        self.model_dir = model_dir
        self.eos_token_ids = eos_token_ids
        self._compiler = None

    def check(self, guide: Guide) -> None:
        """Raises GrammarError (a ValueError naming the problem) for a guide that does not
        compile."""
        if self._compiler is None:
            from transformers import AutoTokenizer

            from appliance.grammars import GrammarCompiler

            hf = AutoTokenizer.from_pretrained(self.model_dir)
            self._compiler = GrammarCompiler(lambda: hf, len(hf), self.eos_token_ids)
        self._compiler.submit(guide).result()
