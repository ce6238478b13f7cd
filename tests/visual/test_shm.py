"""The shared-memory format of image embeddings (`visual.shm`): what is put is what is loaded, for
every supported dtype; unknown dtypes, missing segments and foreign segments are refused."""

from __future__ import annotations

import uuid
from multiprocessing.shared_memory import SharedMemory

import pytest
import torch

from visual.shm import ImageInputError, SharedMemoryImageStore, stack_embeddings


def _handle() -> str:
    return f"appl-test-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_deepstack", [0, 2])
def test_put_then_load_round_trips(dtype, num_deepstack):
    store, handle = SharedMemoryImageStore(), _handle()
    embeds = torch.randn(5, 12).to(dtype)
    deepstack = [torch.randn(5, 12).to(dtype) for _ in range(num_deepstack)]
    assert store.put(handle, embeds, deepstack) == handle
    try:
        loaded = store.load(handle)
        assert loaded.dtype == dtype and loaded.shape == (1 + num_deepstack, 5, 12)
        assert torch.equal(loaded, stack_embeddings(embeds, deepstack))
    finally:
        store.release(handle)
    with pytest.raises(ImageInputError, match="no such shared memory"):
        store.load(handle)
    store.release(handle)  # releasing twice is harmless


def test_unsupported_dtype_and_foreign_segment_are_refused():
    store = SharedMemoryImageStore()
    with pytest.raises(ImageInputError, match="dtype torch.float64 is not supported"):
        store.put(_handle(), torch.zeros(2, 3, dtype=torch.float64))
    foreign = SharedMemory(name=_handle(), create=True, size=128)
    try:
        foreign.buf[:8] = b"NOTANIMG"
        with pytest.raises(ImageInputError, match="bad segment header"):
            store.load(foreign.name)
    finally:
        foreign.close()
        foreign.unlink()
