"""The flashinfer attention backend's host side on CPU, against a stand-in `flashinfer` module:
the page table it plans (one token per page, from req_to_token), one plan per forward however
many layers call it, a new plan for a new forward, and inference-mode metadata (as the engine
makes it). The real kernels are checked against the reference on the GPU (test_attention.py)."""

from __future__ import annotations

import sys
import types

import torch
from test_attention import make_batch

from appliance_kernels.attention import paged_attention_ref


class _Wrapper:
    """Records plans; run() attends with the planned CSR table (flashinfer's documented meaning:
    request b's keys are pages indices[indptr[b]:indptr[b+1]]; causal q rows are the last ones)."""

    plans: list = []

    def __init__(self, workspace, layout, **kwargs) -> None:
        assert layout == "NHD"

    def plan(self, *args, **kwargs) -> None:
        self.decode = len(args) == 7
        if self.decode:
            indptr, indices, last, hq, hkv, d, page = args
            self.qo = torch.arange(indptr.numel())
        else:
            self.qo, indptr, indices, last, hq, hkv, d, page = args
        assert page == 1 and bool((last == 1).all())
        self.indptr, self.indices, self.scale = indptr.long(), indices.long(), kwargs["sm_scale"]
        self.kv_dtype = kwargs["kv_data_type"]
        _Wrapper.plans.append(self)

    def run(self, q, kv, k_scale=None, v_scale=None):
        """k_scale / v_scale: flashinfer's fp8 calibration scales (sm_scale *= k_scale, out *=
        v_scale); the cache must have the dtype planned as kv_data_type."""
        k_cache, v_cache = (c[:, 0] for c in kv)  # [slots, 1, Hkv, D] -> [slots, Hkv, D]
        assert k_cache.dtype == self.kv_dtype and v_cache.dtype == self.kv_dtype
        self.run_scales = (k_scale, v_scale)
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[1]
        for b in range(self.indptr.numel() - 1):
            keys = self.indices[self.indptr[b] : self.indptr[b + 1]]
            rows = q[self.qo[b] : self.qo[b + 1]].float()  # [n, Hq, D]
            k = k_cache[keys].float().repeat_interleave(group, 1)
            v = v_cache[keys].float().repeat_interleave(group, 1)
            s = torch.einsum("nhd,lhd->hnl", rows, k) * self.scale * (k_scale or 1.0)
            n, length = rows.shape[0], keys.numel()
            visible = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
            s = s.masked_fill(~visible, float("-inf"))
            o = torch.einsum("hnl,lhd->nhd", s.softmax(-1), v) * (v_scale or 1.0)
            out[self.qo[b] : self.qo[b + 1]] = o.to(q.dtype)
        return out


def _install(monkeypatch) -> None:
    fake = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_Wrapper, BatchPrefillWithPagedKVCacheWrapper=_Wrapper
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from appliance_kernels import adapters

    monkeypatch.setattr(adapters, "_FI", adapters._FlashInferPlans())
    _Wrapper.plans = []


def test_one_plan_per_forward_and_reference_results(monkeypatch):
    _install(monkeypatch)
    from appliance_kernels.adapters import paged_attention_flashinfer

    for q_lens, seq_lens in (([1, 1, 1], [5, 40, 9]), ([3, 3], [3, 20]), ([6, 0, 4], [30, 2, 4])):
        with torch.inference_mode():  # the engine's metadata are inference tensors
            args = make_batch(q_lens, seq_lens, 6, 2, 16, torch.float32, seed=len(_Wrapper.plans))
            expected = paged_attention_ref(*args, 0.25)
            before = len(_Wrapper.plans)
            for _layer in range(3):  # every layer of a forward passes the same metadata
                got = paged_attention_flashinfer(*args, 0.25, max_q_len=max(q_lens))
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert len(_Wrapper.plans) == before + 1
            assert _Wrapper.plans[-1].decode == (max(q_lens) == 1)


def test_fp8_cache_plans_e4m3_and_passes_the_scales(monkeypatch):
    """An fp8 cache: planned with kv_data_type e4m3, run with k_scale / v_scale as floats; the
    result is the reference over the dequantised cache."""
    from test_attention import fp8_cache

    _install(monkeypatch)
    from appliance_kernels.adapters import paged_attention_flashinfer

    for q_lens, seq_lens in (([1, 1], [7, 30]), ([3, 2], [9, 30])):  # decode and prefill wrappers
        base = make_batch(q_lens, seq_lens, 4, 2, 16, torch.float32, seed=5)
        args, (k_scale, v_scale) = fp8_cache(base, 0.03, 0.7, torch.float32)
        expected = paged_attention_ref(*args, 0.25, k_scale, v_scale)
        with torch.inference_mode():
            got = paged_attention_flashinfer(*args, 0.25, kv_scales=(0.03, 0.7))
        assert _Wrapper.plans[-1].kv_dtype == torch.float8_e4m3fn
        assert _Wrapper.plans[-1].run_scales == (0.03, 0.7)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
