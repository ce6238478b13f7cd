"""Output parsers for chat completions: `<think>` reasoning and Qwen3-coder XML tool calls.

Called by the chat endpoint, one of each per choice, chained: model text → ReasoningParser →
content → ToolCallParser → content + tool-call deltas (tool calls inside reasoning are not parsed).
"""

from __future__ import annotations

from appliance.parsers.qwen3_coder import (
    ParsedDelta,
    ParsedMessage,
    ParserFinishedError,
    ToolCallDelta,
    ToolCallParser,
    parse_tool_calls,
)
from appliance.parsers.reasoning import ReasoningParser, prompt_opens_reasoning, split_reasoning

__all__ = [
    "ParsedDelta",
    "ParsedMessage",
    "ParserFinishedError",
    "ReasoningParser",
    "ToolCallDelta",
    "ToolCallParser",
    "parse_tool_calls",
    "prompt_opens_reasoning",
    "split_reasoning",
]
