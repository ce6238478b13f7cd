"""The appliance: an OpenAI-compatible inference server for Qwen3.5 and Qwen3-VL.

Offline use: `from appliance import LLM, SamplingParams` (and `BeamSearchParams`).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from appliance.offline.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from appliance.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "SamplingParams":
        from appliance.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
