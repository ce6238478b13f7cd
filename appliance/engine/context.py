"""Re-export of the forward context, which lives in `appliance/models/context.py` (the models own
what their layers read per step). Kept for callers outside engine/ and models/ until they import it
from there; the engine itself does not use this module."""

from __future__ import annotations

from appliance.models.context import (
    DeepstackInput,
    ForwardContext,
    forward_context,
    get_forward_context,
)

__all__ = ["DeepstackInput", "ForwardContext", "forward_context", "get_forward_context"]
