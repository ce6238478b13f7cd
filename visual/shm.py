"""Image embeddings in POSIX shared memory: one segment per image, a 64-byte header, the tensor.

The visual server's encoder thread writes segments (through `UntrackedSegmentStore`, whose entries
the cache in visual/cache.py evicts); the workers read them by handle (`SharedMemoryImageStore`,
used by appliance/engine/runner.py and mm_inputs.py).

Embeddings of one image are one tensor [1 + num_deepstack, num_tokens, hidden]: row 0 is spliced
over the image's <|image_pad|> tokens, row 1 + i is added after decoder layer i (Qwen3-VL).
"""

from __future__ import annotations

import struct
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch


class ImageInputError(ValueError):
    """Image embeddings that cannot be stored or used: here a missing segment, a bad header or an
    unsupported dtype; on the worker also offsets, counts and shapes that do not fit the request."""


def stack_embeddings(
    embeds: torch.Tensor, deepstack: list[torch.Tensor] | tuple = ()
) -> torch.Tensor:
    """ViT outputs of one image ([n, H] and per deepstack layer [n, H]) -> [1 + D, n, H]."""
    return torch.stack([embeds, *deepstack])


# Segment layout: 64-byte header (magic, dtype code, 3 dims) then the tensor bytes, C order.
_MAGIC = b"APPLIMG1"
_HEADER = struct.Struct("<8sI3q")
_HEADER_BYTES = 64
_DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
_CODES = {v: k for k, v in _DTYPES.items()}


class SharedMemoryImageStore:
    """Embeddings in POSIX shared memory, one segment per image, named by the handle. The visual
    server writes (and owns, evicts, unlinks) segments; workers only read them."""

    def __init__(self) -> None:
        self._owned: dict[str, SharedMemory] = {}  # segments this process created

    def put(
        self, handle: str, embeds: torch.Tensor, deepstack: list[torch.Tensor] | tuple = ()
    ) -> str:
        tensor = stack_embeddings(embeds, deepstack).detach().to("cpu").contiguous()
        if tensor.dtype not in _CODES:
            raise ImageInputError(f"image embeddings dtype {tensor.dtype} is not supported")
        raw = tensor.view(torch.uint8).reshape(-1)
        shm = SharedMemory(name=handle, create=True, size=_HEADER_BYTES + raw.numel())
        shm.buf[: _HEADER.size] = _HEADER.pack(_MAGIC, _CODES[tensor.dtype], *tensor.shape)
        dst = torch.frombuffer(shm.buf, dtype=torch.uint8, count=raw.numel(), offset=_HEADER_BYTES)
        dst.copy_(raw)
        del dst  # no exported pointers may outlive the segment
        self._owned[handle] = shm
        return handle

    def release(self, handle: str) -> None:
        """Unlink a segment this process wrote (the visual server's cache eviction)."""
        shm = self._owned.pop(handle, None)
        if shm is not None:
            shm.close()
            shm.unlink()

    def load(self, handle: str) -> torch.Tensor:
        try:
            shm = SharedMemory(name=handle)
        except FileNotFoundError:
            raise ImageInputError(f"image embeddings {handle!r}: no such shared memory") from None
        if handle not in self._owned:
            # Python < 3.13 registers attached segments too; the reader must not unlink at exit.
            resource_tracker.unregister(shm._name, "shared_memory")
        try:
            magic, code, *shape = _HEADER.unpack(bytes(shm.buf[: _HEADER.size]))
            if magic != _MAGIC or code not in _DTYPES:
                raise ImageInputError(f"image embeddings {handle!r}: bad segment header")
            dtype = _DTYPES[code]
            count = shape[0] * shape[1] * shape[2] * torch.empty((), dtype=dtype).element_size()
            src = torch.frombuffer(shm.buf, dtype=torch.uint8, count=count, offset=_HEADER_BYTES)
            out = src.clone().view(dtype).reshape(shape)
            del src
        finally:
            shm.close()
        return out


class UntrackedSegmentStore:
    """The visual server's writer side of SharedMemoryImageStore, kept out of multiprocessing's
    resource tracker. Every spawned role shares the launcher's tracker, which holds one entry per
    name: a worker's attach + unregister would drop the visual server's entry, and the visual
    server's own unlink would then fail inside the tracker. Segments are unlinked by the cache
    (eviction, shutdown) and, after a crash, by the launcher (`remove_leftover_segments`)."""

    def __init__(self) -> None:
        self._store = SharedMemoryImageStore()

    def put(self, handle: str, embeds, deepstack=()) -> str:
        self._store.put(handle, embeds, deepstack)
        resource_tracker.unregister("/" + handle, "shared_memory")  # SharedMemory's POSIX name
        return handle

    def load(self, handle: str):
        return self._store.load(handle)

    def release(self, handle: str) -> None:
        resource_tracker.register("/" + handle, "shared_memory")  # unlink() unregisters it
        self._store.release(handle)
