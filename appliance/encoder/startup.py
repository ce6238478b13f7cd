"""The visual role's startup decisions: whether it runs at all (`wants_visual_server`, the one rule
of the launcher and the API server), where the ViT runs (`vit_placement`) and its worst-case ViT
reservation as the launcher's VisualInfo.

Called by appliance/launch.py, appliance/server/images.py, appliance/encoder/process.py,
appliance/offline/images.py and ops/gpu/check_vision.py. Torch-free at import: the API server
imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from appliance.config import EngineConfig, VisualConfig
from appliance.messages import VisualInfo
from visual.checkpoint import has_vision_tower

if TYPE_CHECKING:
    import torch

    from visual.encoder import VisionEncoder


def wants_visual_server(model_dir: str | Path, config: VisualConfig) -> bool:
    """The launcher's and the API server's one rule: image input is on and the checkpoint has a
    vision tower (then a visual server runs and image parts are accepted)."""
    return config.vision and has_vision_tower(model_dir)


def vit_placement(engine: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """Where the ViT runs and in what dtype: worker rank 0's device (the reservation is held
    there; on CUDA it becomes the current device) and the model's dtype (auto: bfloat16 on CUDA,
    float32 on CPU, as the runner resolves it). The visual server's and the offline LLM's."""
    import torch

    name = engine.parallel.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    dtype = engine.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, dtype)


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


def describe_reservation(info: VisualInfo) -> str:
    """The startup log line of a reservation."""
    fixed = " (--visual-reserved-mem-gb)" if info.peak_bytes < 0 else ""
    return (
        f"ViT worst case: {info.batch_size} x grid {info.worst_case_grid} -> peak "
        f"{max(info.peak_bytes, 0) / 2**30:.3f} GiB, reserving {info.reserved_bytes / 2**30:.3f} "
        f"GiB on {info.device}{fixed}"
    )
