"""paged_attention_triton and the KV store (kv_cache.py) vs the torch references."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from kernel_cases import DEVICE, generator, gpu, randn
from tolerances import ACCUMULATING, assert_close, poison

import appliance_kernels.attention as attn
from appliance_kernels.attention import paged_attention, paged_attention_ref, paged_attention_triton
from appliance_kernels.fp8 import FP8_DTYPE
from appliance_kernels.kv_cache import KVScales, store_kv_ref, store_kv_triton


def make_batch(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, dtype, seed, q_view=False):
    """Random KV pool whose slots are scattered through req_to_token, and the query rows."""
    gen = generator(seed)
    batch = len(q_lens)
    max_len = max(seq_lens) + 3
    num_slots = sum(seq_lens) + 17
    perm = torch.randperm(num_slots, generator=gen)
    req_to_token = torch.zeros(batch + 2, max_len, dtype=torch.int32)
    req_slots = torch.randperm(batch + 2, generator=gen)[:batch]
    used = 0
    for b, n in enumerate(seq_lens):
        req_to_token[req_slots[b], :n] = perm[used : used + n].int()
        used += n
    total = sum(q_lens)
    if q_view:  # q as a view into a wider projection output, as the model produces it
        wide = randn(total, num_q_heads * head_dim * 2, dtype=dtype, seed=seed + 1)
        q = wide[:, : num_q_heads * head_dim].view(total, num_q_heads, head_dim)
    else:
        q = randn(total, num_q_heads, head_dim, dtype=dtype, seed=seed + 1)
    k_cache = randn(num_slots, num_kv_heads, head_dim, dtype=dtype, seed=seed + 2)
    v_cache = randn(num_slots, num_kv_heads, head_dim, dtype=dtype, seed=seed + 3)
    cu = torch.tensor([0] + list(q_lens)).cumsum(0).int()
    to = dict(device=DEVICE)
    return (
        q,
        k_cache,
        v_cache,
        req_to_token.to(**to),
        req_slots.to(**to),
        cu.to(**to),
        torch.tensor(seq_lens, dtype=torch.int32, **to),
    )


CASES = {
    # name: (q_lens, seq_lens, Hq, Hkv, D)
    "decode_gqa2": ([1, 1, 1, 1], [1, 5, 70, 130], 4, 2, 32),
    "decode_group6_d24": ([1, 1], [33, 200], 6, 1, 24),
    "verify_rows": ([3, 3, 3], [3, 40, 129], 4, 2, 32),
    "prefill_cached_prefix": ([20, 37, 0, 5], [50, 37, 9, 5], 4, 2, 32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_reference(case, dtype):
    q_lens, seq_lens, hq, hkv, d = CASES[case]
    args = make_batch(
        q_lens, seq_lens, hq, hkv, d, dtype, seed=len(case), q_view=case == "verify_rows"
    )
    scale = d**-0.5
    expected = paged_attention_ref(*args, scale)
    out = poison(torch.empty(args[0].shape, dtype=dtype, device=DEVICE))
    got = paged_attention_triton(*args, scale, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, expected, dtype, factor=ACCUMULATING, name=case)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_split_kv_gives_same_result(num_splits):
    args = make_batch([1, 2], [300, 90], 4, 2, 32, torch.float32, seed=7)
    expected = paged_attention_ref(*args, 0.2)
    got = paged_attention_triton(*args, 0.2, max_q_len=2, num_splits=num_splits)
    assert_close(got, expected, torch.float32, name=f"splits={num_splits}")


def test_many_splits_merge_in_chunks():
    """64 splits: the merge sums the partial outputs 32 splits at a time; 5000 keys put non-empty
    splits in both chunks (128-key blocks), the short request leaves most of its splits empty."""
    args = make_batch([1, 1], [5000, 90], 4, 2, 32, torch.float32, seed=11)
    expected = paged_attention_ref(*args, 0.2)
    got = paged_attention_triton(*args, 0.2, max_q_len=1, num_splits=64)
    assert_close(got, expected, torch.float32, name="splits=64")


def gate_view(q: torch.Tensor, seed: int) -> torch.Tensor:
    """A gate like the layer's: [T, H, D] interleaved per head with q in one projection row."""
    t, h, d = q.shape
    wide = randn(t, h, 2 * d, dtype=q.dtype, seed=seed) * 3
    return wide[:, :, d:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case,splits", [("decode_gqa2", 1), ("decode_gqa2", 4), ("verify_rows", 2), ("prefill", 1)]
)
def test_output_gate_is_fused(case, splits, dtype):
    """gate= multiplies the output by sigmoid(gate) in the kernel's store (or the split merge):
    the same as the reference's product, which is attention, then the gate."""
    q_lens, seq_lens, hq, hkv, d = CASES.get(case, ([20, 37, 0, 5], [50, 37, 9, 5], 4, 2, 32))
    args = make_batch(q_lens, seq_lens, hq, hkv, d, dtype, seed=31)
    gate = gate_view(args[0], seed=32)
    expected = paged_attention_ref(*args, 0.3, gate=gate)
    plain = paged_attention_ref(*args, 0.3).float() * torch.sigmoid(gate.float())
    assert_close(expected, plain, dtype, factor=ACCUMULATING, name="gate meaning")
    got = paged_attention_triton(
        *args,
        0.3,
        max_q_len=max(q_lens),
        num_splits=splits if case != "prefill" else None,
        gate=gate,
    )
    assert_close(got, expected, dtype, factor=ACCUMULATING, name=f"gated {case}")
    assert_close(paged_attention(*args, 0.3, gate=gate), expected, dtype, factor=ACCUMULATING)


def test_dispatcher_on_cpu_uses_reference():
    args = make_batch([2, 1], [5, 9], 4, 2, 16, torch.float32, seed=3)
    got = paged_attention(*args, 0.25)
    assert_close(got, paged_attention_ref(*args, 0.25), torch.float32, name="dispatcher")
    assert torch.equal(got, paged_attention_ref(*args, 0.25)) or DEVICE.type == "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_only_named_slots(dtype):
    k = randn(5, 2, 24, dtype=dtype, seed=1)
    wide_v = randn(5, 2 * 24 * 3, dtype=dtype, seed=2)
    v = wide_v[:, 24 * 2 : 24 * 4].view(5, 2, 24)  # strided view
    slots = torch.tensor([7, 0, 3, 11, 4], device=DEVICE)
    caches = [poison(torch.empty(12, 2, 24, dtype=dtype, device=DEVICE)) for _ in range(4)]
    store_kv_ref(k, v, caches[0], caches[1], slots)
    store_kv_triton(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[2][slots], k) and torch.equal(caches[3][slots], v)
    untouched = torch.ones(12, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(caches[2][untouched]).all() and torch.isnan(caches[3][untouched]).all()


@gpu
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([1] * 64, [4096] * 64),
        ([1], [32768]),
        ([4] * 16, [2048] * 16),
        ([8192], [8192]),
        ([2048, 1024], [6144, 1024]),
    ],
    ids=["decode64x4k", "decode1x32k", "verify16", "prefill8k", "prefill_prefix"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_full_size_qwen35_27b(q_lens, seq_lens, dtype):
    args = make_batch(q_lens, seq_lens, 24, 4, 256, dtype, seed=11)
    expected = paged_attention_ref(*args, 256**-0.5)
    got = paged_attention_triton(*args, 256**-0.5)
    assert_close(got, expected, dtype, factor=ACCUMULATING, name="full")
    gate = gate_view(args[0], seed=12)  # the layer's fused output gate (decode, merge, prefill)
    expected = paged_attention_ref(*args, 256**-0.5, gate=gate)
    got = paged_attention_triton(*args, 256**-0.5, gate=gate)
    assert_close(got, expected, dtype, factor=ACCUMULATING, name="full gated")


@gpu
@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="optional flashinfer not installed"
)
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([1] * 16, [4096] * 16),
        ([1, 1, 1], [7, 300, 2049]),
        ([4] * 8, [1024] * 8),
        ([700, 5], [900, 5]),
    ],
    ids=["decode16", "decode_ragged", "verify8", "prefill_prefix"],
)
def test_flashinfer_adapter_matches_reference(q_lens, seq_lens):
    """The flashinfer backend (page-size-1 view of our cache) == the reference, at 27B heads."""
    from appliance_kernels.adapters import paged_attention_flashinfer

    args = make_batch(q_lens, seq_lens, 24, 4, 256, torch.bfloat16, seed=12)
    expected = paged_attention_ref(*args, 256**-0.5)
    got = paged_attention_flashinfer(*args, 256**-0.5)
    assert_close(got, expected, torch.bfloat16, factor=ACCUMULATING, name="flashinfer")
    again = paged_attention_flashinfer(*args, 256**-0.5)  # the cached plan is reused
    assert torch.equal(again, got)


# ------------------------------------------------------------------ fp8 KV cache


def fp8_cache(args, k_scale: float, v_scale: float, dtype: torch.dtype):
    """make_batch's caches stored as e4m3 with per-layer scales (through the reference store), and
    the scales as the [1] fp32 device tensors the kernels take."""
    q, k_cache, v_cache, *meta = args
    scales = [torch.tensor([s], dtype=torch.float32, device=DEVICE) for s in (k_scale, v_scale)]
    slots = torch.arange(k_cache.shape[0], device=DEVICE)
    caches = [torch.empty(k_cache.shape, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    store_kv_ref(k_cache, v_cache, *caches, slots, *scales)
    return (q.to(dtype), *caches, *meta), scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_kv_attention_matches_dequantized_reference(case, dtype):
    """e4m3 cache with scales != 1: Triton == the reference that dequantises the same cache, and
    the reference equals plain attention over the dequantised values (what fp8 KV means)."""
    q_lens, seq_lens, hq, hkv, d = CASES[case]
    base = make_batch(q_lens, seq_lens, hq, hkv, d, torch.float32, seed=len(case) + 40)
    args, (k_scale, v_scale) = fp8_cache(base, 0.02, 0.5, dtype)
    scale = d**-0.5
    expected = paged_attention_ref(*args, scale, k_scale, v_scale)
    out = poison(torch.empty(args[0].shape, dtype=dtype, device=DEVICE))
    got = paged_attention_triton(*args, scale, out=out, k_scale=k_scale, v_scale=v_scale)
    assert_close(got, expected, dtype, factor=ACCUMULATING, name=f"fp8 {case}")
    deq = (args[1].float() * 0.02, args[2].float() * 0.5)
    plain = paged_attention_ref(args[0].float(), *deq, *args[3:], scale)
    assert_close(expected, plain, dtype, factor=ACCUMULATING, name=f"fp8 meaning {case}")


@pytest.mark.parametrize("tile", [(128, 2, 4), (32, 3, 2), (64, 5, 4)])
def test_fp8_kv_decode_tile_override(tile, monkeypatch):
    """ATTN_TUNING["fp8_tile"] (the fp8 cache's own decode tiles): same result, verify rows and a
    ragged last block included."""
    monkeypatch.setitem(attn.ATTN_TUNING, "fp8_tile", tile)
    base = make_batch([1, 3], [300, 77], 4, 2, 32, torch.float32, seed=9)
    args, (k_scale, v_scale) = fp8_cache(base, 0.05, 3.0, torch.bfloat16)
    expected = paged_attention_ref(*args, 0.2, k_scale, v_scale)
    got = paged_attention_triton(*args, 0.2, max_q_len=3, k_scale=k_scale, v_scale=v_scale)
    assert_close(got, expected, torch.bfloat16, factor=ACCUMULATING, name=f"fp8 tile {tile}")


@pytest.mark.parametrize("v_pairs", [True, False])
def test_fp8_v_read_as_pairs_is_exact_for_every_e4m3_value(v_pairs, monkeypatch):
    """One key per request, so the output is that key's V row times v_scale, exactly (e4m3 values
    are bf16 ones): every byte but the two NaNs, in even and odd columns, read as int16 column
    pairs (ATTN_TUNING["fp8_v_pairs"], the decode default) and byte by byte."""
    monkeypatch.setitem(attn.ATTN_TUNING, "fp8_v_pairs", v_pairs)
    base = make_batch([1, 1], [1, 1], 2, 1, 256, torch.float32, seed=21)
    args, (k_scale, v_scale) = fp8_cache(base, 0.5, 0.25, torch.bfloat16)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F] + [0x7E, 0xFE])
    v_bytes = args[2].view(torch.uint8)
    slots = [int(args[3][int(args[4][b]), 0]) for b in range(2)]
    for b, slot in enumerate(slots):  # the second request's row shifted by one column
        v_bytes[slot, 0] = codes.roll(b).to(torch.uint8).to(DEVICE)
    got = paged_attention_triton(*args, 0.1, k_scale=k_scale, v_scale=v_scale)
    for b, slot in enumerate(slots):
        row = (args[2][slot, 0].float() * 0.25).to(torch.bfloat16)
        assert torch.equal(got[b], row.expand(2, -1)), f"request {b}"
    assert got.float().abs().max() == 448 * 0.25 and (got == 2**-9 * 0.25).any()


@pytest.mark.parametrize("tile", [(32, 7, 4), (64, 5, 4)])
def test_bf16_kv_decode_tile_override(tile, monkeypatch):
    """ATTN_TUNING["tile"] (a bf16 cache's decode tiles; 5+ stages double-buffer the gathered
    keys): same result over verify rows and ragged last blocks."""
    monkeypatch.setitem(attn.ATTN_TUNING, "tile", tile)
    args = make_batch([1, 3, 1], [300, 77, 129], 4, 2, 32, torch.bfloat16, seed=10)
    expected = paged_attention_ref(*args, 0.2)
    got = paged_attention_triton(*args, 0.2, max_q_len=3)
    assert_close(got, expected, torch.bfloat16, factor=ACCUMULATING, name=f"bf16 tile {tile}")


def test_fp8_v_at_an_odd_byte_offset_is_read_byte_by_byte():
    """A V cache that cannot be viewed as int16 words (odd storage offset) takes the byte read."""
    base = make_batch([1, 1], [40, 9], 4, 2, 32, torch.float32, seed=22)
    args, (k_scale, v_scale) = fp8_cache(base, 0.05, 3.0, torch.bfloat16)
    flat = torch.empty(args[2].numel() + 1, dtype=FP8_DTYPE, device=DEVICE)
    v_odd = flat[1:].view(args[2].shape)
    v_odd.copy_(args[2])
    args = (args[0], args[1], v_odd, *args[3:])
    expected = paged_attention_ref(*args, 0.2, k_scale, v_scale)
    got = paged_attention_triton(*args, 0.2, k_scale=k_scale, v_scale=v_scale)
    assert_close(got, expected, torch.bfloat16, factor=ACCUMULATING, name="odd offset")


def test_max_splits_caps_the_split_heuristic(monkeypatch):
    cpu = torch.device("cpu")  # the interpreter's machine: 8 SMs
    assert attn._attention_splits(1, 1, cpu, False) == 8
    monkeypatch.setitem(attn.ATTN_TUNING, "max_splits", 2)
    assert attn._attention_splits(1, 1, cpu, False) == 2
    assert attn._attention_splits(1, 1, cpu, True) == 2
    assert attn._attention_splits(1, 17, cpu, False) == 1  # a long query block is not split


def test_fp8_kv_split_kv_applies_v_scale_before_the_merge():
    base = make_batch([1, 2], [300, 90], 4, 2, 32, torch.float32, seed=8)
    args, (k_scale, v_scale) = fp8_cache(base, 0.05, 3.0, torch.float32)
    expected = paged_attention_ref(*args, 0.2, k_scale, v_scale)
    for splits in (1, 4):
        got = paged_attention_triton(
            *args, 0.2, max_q_len=2, num_splits=splits, k_scale=k_scale, v_scale=v_scale
        )
        assert_close(got, expected, torch.float32, name=f"fp8 splits={splits}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_fp8_divides_by_the_scale_and_saturates(dtype):
    k = randn(6, 2, 24, dtype=dtype, seed=4) * 3
    v = randn(6, 2, 24, dtype=dtype, seed=5)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 447.0 * 0.5, 0.0])  # saturates at +-448 (scale 0.5)
    scales = [torch.tensor([s], device=DEVICE) for s in (0.5, 0.01)]
    slots = torch.tensor([9, 2, 0, 5, 7, 3], device=DEVICE)
    ref = [torch.zeros(10, 2, 24, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    got = [torch.zeros(10, 2, 24, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    store_kv_ref(k, v, *ref, slots, *scales)
    store_kv_triton(k, v, *got, slots, *scales)
    for r, g in zip(ref, got):
        assert torch.equal(r.view(torch.uint8), g.view(torch.uint8))
    row = got[0][9, 0, :4].float()
    assert row.tolist()[:2] == [448.0, -448.0] and not torch.isnan(got[0].float()).any()
    torch.testing.assert_close(
        got[1][slots].float() * 0.01, v.float(), rtol=0.07, atol=0.01 * 2**-6
    )
    assert torch.equal(got[0][1].float(), torch.zeros(2, 24, device=DEVICE))  # untouched slot


def test_fp8_cache_without_scales_is_refused():
    args = make_batch([1], [5], 4, 2, 16, torch.float32, seed=2)
    fp8_args, _ = fp8_cache(args, 1.0, 1.0, torch.float32)
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention_triton(*fp8_args, 0.25)


def test_dispatcher_passes_kv_scales_to_the_reference_on_cpu():
    base = make_batch([2, 1], [5, 9], 4, 2, 16, torch.float32, seed=3)
    args, (k_scale, v_scale) = fp8_cache(base, 0.1, 2.0, torch.float32)
    scales = KVScales(k_scale, v_scale, 0.1, 2.0)
    got = paged_attention(*args, 0.25, kv_scales=scales)
    assert_close(got, paged_attention_ref(*args, 0.25, k_scale, v_scale), torch.float32, name="d")


@gpu
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [([1] * 64, [4096] * 64), ([1], [32768]), ([4] * 16, [2048] * 16), ([2048, 5], [6144, 5])],
    ids=["decode64x4k", "decode1x32k", "verify16", "prefill_prefix"],
)
def test_full_size_fp8_kv(q_lens, seq_lens):
    base = make_batch(q_lens, seq_lens, 24, 4, 256, torch.bfloat16, seed=13)
    args, (k_scale, v_scale) = fp8_cache(base, 0.02, 0.02, torch.bfloat16)
    expected = paged_attention_ref(*args, 256**-0.5, k_scale, v_scale)
    got = paged_attention_triton(*args, 256**-0.5, k_scale=k_scale, v_scale=v_scale)
    assert_close(got, expected, torch.bfloat16, factor=ACCUMULATING, name="full fp8")


@gpu
@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="optional flashinfer not installed"
)
@pytest.mark.parametrize(
    "q_lens,seq_lens", [([1] * 16, [4096] * 16), ([4] * 8, [1024] * 8), ([700, 5], [900, 5])]
)
def test_flashinfer_fp8_kv_matches_reference(q_lens, seq_lens):
    """flashinfer with kv_data_type e4m3 and its k_scale / v_scale == our dequantising reference."""
    from appliance_kernels.adapters import paged_attention_flashinfer

    base = make_batch(q_lens, seq_lens, 24, 4, 256, torch.bfloat16, seed=14)
    args, (k_scale, v_scale) = fp8_cache(base, 0.02, 0.03, torch.bfloat16)
    expected = paged_attention_ref(*args, 256**-0.5, k_scale, v_scale)
    got = paged_attention_flashinfer(*args, 256**-0.5, kv_scales=(0.02, 0.03))
    assert_close(got, expected, torch.bfloat16, factor=ACCUMULATING, name="flashinfer fp8")
