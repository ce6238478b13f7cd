"""The visual role's startup decisions: whether it runs at all (`wants_visual_server`, the one rule
of the launcher and the API server) and its worst-case ViT reservation as the launcher's VisualInfo.

Called by appliance/launch.py, appliance/server/images.py, appliance/encoder/process.py and
ops/gpu/check_vision.py. Torch-free at import: the API server imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from appliance.config import VisualConfig
from appliance.messages import VisualInfo
from visual.checkpoint import has_vision_tower

if TYPE_CHECKING:
    from visual.encoder import VisionEncoder


def wants_visual_server(model_dir: str | Path, config: VisualConfig) -> bool:
    """The launcher's and the API server's one rule: image input is on and the checkpoint has a
    vision tower (then a visual server runs and image parts are accepted)."""
    return config.vision and has_vision_tower(model_dir)


def plan_reservation(encoder: VisionEncoder, config: VisualConfig) -> VisualInfo:
    """`visual.reservation.plan_reservation` for the role's config: visual_max_batch_size images of
    the worst grid, their activation peak and the bytes the workers on the ViT's device hold back
    (--visual-reserved-mem-gb >= 0 overrides), as the VisualInfo that goes in ProcessReady."""
    from visual import reservation  # torch: only where a ViT is loaded

    plan = reservation.plan_reservation(
        encoder,
        config.max_image_pixels,
        config.visual_max_batch_size,
        config.visual_reserved_mem_gb,
    )
    return VisualInfo(
        plan.device, plan.reserved_bytes, plan.peak_bytes, plan.worst_case_grid, plan.batch_size
    )
