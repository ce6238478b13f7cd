"""Worst-case activation memory of the ViT: the largest input an admitted image can become, the peak
its batch needs above the weights, and the rounded reservation the workers leave free for it.

Called by the visual server at startup (appliance/encoder/startup.py turns the `Reservation` into
the VisualInfo that travels to the launcher and on to the worker that shares the ViT's device as
`ModelRunner(reserved_bytes=...)`). On CUDA the peak is measured for real: the allocator's
footprint (`torch.cuda.max_memory_reserved`), fragmentation included. On CPU the same worst case
runs on the meta device under `MemoryTracker`, which adds up tensor storages as ops create them and
subtracts them as they are freed, so the arithmetic is exercised without the memory (SDPA's
internal workspace is invisible to it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from visual.encoder import VisionEncoder
from visual.preprocess import PreprocessConfig, worst_case_pixels
from visual.qwen_vit import QwenVisionTransformer

GIB = 2**30
RESERVE_GRANULARITY = 64 * 2**20  # reservations are whole multiples of this
RESERVE_MARGIN = 0.10  # headroom over the measured peak for allocator fragmentation


@dataclass(frozen=True)
class Reservation:
    """The worst case the ViT was planned for and the device bytes held back for it."""

    device: str  # the ViT's device ("cuda:0", "cpu")
    reserved_bytes: int  # device bytes the workers on that device leave free for ViT activations
    peak_bytes: int  # activation peak of the worst case (-1 when a fixed reservation was given)
    worst_case_grid: tuple[int, int, int]  # per-image patch grid of the worst case
    batch_size: int  # images in the worst-case batch


# ------------------------------------------------------------------------------ the worst input


def worst_case_grid(config: PreprocessConfig, max_image_pixels: int) -> tuple[int, int, int]:
    """A (t, h, w) patch grid with at least as many patches as any admissible image: a square of
    merge windows (attention cost depends on the patch count of an image, not on its shape)."""
    patches = worst_case_pixels(config, max_image_pixels) / config.patch_size**2
    side = config.merge_size * math.ceil(math.sqrt(patches) / config.merge_size)
    return 1, side, side


def reservation_bytes(
    peak_bytes: int, margin: float = RESERVE_MARGIN, granularity: int = RESERVE_GRANULARITY
) -> int:
    """Measured peak -> bytes to hold back: peak plus margin, rounded up to the granularity."""
    if peak_bytes < 0:
        raise ValueError(f"peak_bytes: expected an integer >= 0, got {peak_bytes}")
    if peak_bytes == 0:
        return 0
    return math.ceil(peak_bytes * (1 + margin) / granularity) * granularity


def override_bytes(gb: float) -> int:
    """--visual-reserved-mem-gb in bytes."""
    return int(round(gb * GIB))


# ------------------------------------------------------------------------------ measuring


class MemoryTracker(TorchDispatchMode):
    """Live bytes of tensor storages created by ops inside the mode, and their peak.

    Each op's outputs are looked at once: a storage not seen before adds its size; storages whose
    last tensor was freed (weak reference expired) are subtracted before the next op counts. Views
    share their base's storage and add nothing. Tensors created before the mode (weights) are not
    counted. Works on any device, including meta (sizes without memory)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key = storage._cdata
                if key not in self._live:
                    self._live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def _meta_tower(encoder: VisionEncoder) -> QwenVisionTransformer:
    with torch.device("meta"):
        return QwenVisionTransformer(encoder.config).to(encoder.dtype)


@torch.inference_mode()
def tracked_peak(encoder: VisionEncoder, grids: list[tuple[int, int, int]]) -> int:
    """Activation peak of the worst case counted by MemoryTracker on a meta copy of the tower:
    the fp32 input rows as preprocessing hands them over, the cast, every block, the mergers."""
    tower = _meta_tower(encoder)
    patches = sum(t * h * w for t, h, w in grids)
    with MemoryTracker() as tracker:
        pixel_values = torch.empty(patches, encoder.config.patch_dim, device="meta")
        embeds, deepstack = tower(pixel_values.to(encoder.dtype), grids)
        del pixel_values, embeds, deepstack
    return tracker.peak


@torch.inference_mode()
def cuda_peak(encoder: VisionEncoder, grids: list[tuple[int, int, int]]) -> int:
    """Peak device footprint above what existed before (the weights) while the worst case runs
    exactly as a batch does (host fp32 rows in, host embeddings out). The footprint is the caching
    allocator's peak of *reserved* segments, not of live tensors: fragmentation between the
    blocks of a 17 GiB forward is real memory the process needs (an H200 burst of eight
    max-size images, measured against the allocated peak of 17.5 GiB + 10 %, ran out of memory).
    The cache is emptied afterwards: the workers, which start after this, see that memory as free
    and hold the reservation back themselves."""
    device = encoder.device
    patches = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.randn(patches, encoder.config.patch_dim)  # host, as from numpy
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_reserved(device)
    embeds, deepstack = encoder.encode(pixel_values, grids)
    host = [embeds.cpu(), *(d.cpu() for d in deepstack)]
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - base
    del embeds, deepstack, host
    torch.cuda.empty_cache()
    return peak


def measure_peak(encoder: VisionEncoder, grids: list[tuple[int, int, int]]) -> int:
    """Activation peak of encoding `grids` in one batch: measured on CUDA, tracked on meta else."""
    if encoder.device.type == "cuda":
        return cuda_peak(encoder, grids)
    return tracked_peak(encoder, grids)


def plan_reservation(
    encoder: VisionEncoder, max_image_pixels: int, batch_size: int, reserved_mem_gb: float = -1.0
) -> Reservation:
    """The worst case (`batch_size` images of the worst grid for images of at most
    `max_image_pixels` decoded pixels), its peak and the bytes the workers on the ViT's device hold
    back; `reserved_mem_gb` >= 0 (--visual-reserved-mem-gb) overrides the measurement."""
    grid = worst_case_grid(encoder.preprocess, max_image_pixels)
    if reserved_mem_gb >= 0:
        peak, reserved = -1, override_bytes(reserved_mem_gb)
    else:
        peak = measure_peak(encoder, [grid] * batch_size)
        reserved = reservation_bytes(peak)
    return Reservation(str(encoder.device), reserved, peak, grid, batch_size)
