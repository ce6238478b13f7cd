"""Block-scaled fp8 (DeepSeek-V3 / Qwen "-FP8" checkpoints): e4m3 weights with one dequantisation
scale per [block_n, block_k] tile, activations quantised per token and per group of block_k
columns. References, the per-token-group quantiser in Triton, the block GEMM (the GEMM kernel of
appliance_kernels/fp8.py with block scales), cuBLASLt's 128 x 128 block recipe for prefill sizes
(`fp8_block_mm_torch`, routed by `block_mm_route`) and the dispatcher `fp8_block_linear`. Called by
appliance/models/layers/quant_methods.py and appliance_kernels/fp8_moe.py.

Scales are dequantisation scales (x ~= x_q * scale), as `weight_scale_inv` in the checkpoints.
A weight [N, K] has scales [ceil(N / block_n), ceil(K / block_k)]; an activation [M, K] has
[M, ceil(K / block_k)].
"""

from __future__ import annotations

import logging

import torch

from appliance_kernels import backends
from appliance_kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, launch_fp8_mm
from appliance_kernels.fp8_gemv import block_gemv_fits, fp8_gemv_block, gemv_wins
from appliance_kernels.fp8_splitk import BLOCK_K as SPLITK_BLOCK_K
from appliance_kernels.fp8_splitk import BLOCK_N as SPLITK_BLOCK_N
from appliance_kernels.fp8_splitk import fp8_splitk_block_mm, splitk_wins
from appliance_kernels.triton_utils import check_last_dim_contiguous, jit, next_pow2, tl, use_triton

Block = tuple[int, int]  # (block_n, block_k)
log = logging.getLogger(__name__)


# ------------------------------------------- references -------------------------------------------


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: Block) -> torch.Tensor:
    """[.., ceil(rows/bn), ceil(cols/bk)] -> one scale per element [.., rows, cols]."""
    block_n, block_k = block
    full = scale.float().repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)
    return full[..., :rows, :cols]


def dequantize_block(w_q: torch.Tensor, scale: torch.Tensor, block: Block) -> torch.Tensor:
    """w_q [.., N, K] e4m3, scale [.., N/bn, K/bk] -> fp32 [.., N, K]."""
    return w_q.float() * expand_block_scale(scale, w_q.shape[-2], w_q.shape[-1], block)


def quantize_block_ref(w: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 scales [ceil(N/bn), ceil(K/bk)]): amax of each tile / 448."""
    block_n, block_k = block
    rows, cols = w.shape
    pad_n, pad_k = -rows % block_n, -cols % block_k
    tiles = torch.nn.functional.pad(w.float(), (0, pad_k, 0, pad_n))
    tiles = tiles.reshape((rows + pad_n) // block_n, block_n, (cols + pad_k) // block_k, block_k)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
    full = expand_block_scale(scale, rows, cols, block)
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def per_token_group_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] e4m3, scale [M, ceil(K/group)] fp32): one scale per row and group."""
    rows, cols = x.shape
    pad = -cols % group
    groups = torch.nn.functional.pad(x.float(), (0, pad)).reshape(rows, -1, group)
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    full = scale.repeat_interleave(group, dim=1)[:, :cols]
    return (x.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_block_mm_ref(
    a_q: torch.Tensor,  # [M, K] e4m3
    a_scale: torch.Tensor,  # [M, ceil(K/bk)]
    b_q: torch.Tensor,  # [N, K] e4m3
    b_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)]
    block: Block,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Dequantise both operands and multiply in fp32."""
    a = a_q.float() * a_scale.float().repeat_interleave(block[1], dim=1)[:, : a_q.shape[1]]
    out = a @ dequantize_block(b_q, b_scale, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# --------------------------------------------- Triton ---------------------------------------------


@jit
def _group_quant_kernel(
    x_ptr, q_ptr, s_ptr, cols, stride_x, stride_q, stride_s, stride_sg, GROUP: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    ok = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / 448.0, 1e-12)
    tl.store(s_ptr + row * stride_s + group * stride_sg, scale)
    q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=ok)


def per_token_group_quant_triton(
    x: torch.Tensor,
    group: int,
    pad_rows_to: int = 1,  # rows allocated up to a multiple of this (left unwritten)
    scale_column_major: bool = False,  # scales [rows, groups] with strides (1, rows)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows', K] e4m3, scale [rows', groups] fp32), rows' = rows rounded up to pad_rows_to;
    only the first `rows` are written. The padded, column-major form is what cuBLASLt's 1 x 128
    block scaling takes (`fp8_block_mm_torch`)."""
    check_last_dim_contiguous("x", x)
    if group != next_pow2(group):
        raise ValueError(f"per_token_group_quant: group {group} must be a power of two")
    rows, cols = x.shape
    num_groups = -(-cols // group)
    alloc = -(-rows // pad_rows_to) * pad_rows_to
    q = torch.empty(alloc, cols, dtype=FP8_DTYPE, device=x.device)
    if scale_column_major:
        scale = torch.empty(num_groups, alloc, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(alloc, num_groups, dtype=torch.float32, device=x.device)
    if rows:
        _group_quant_kernel[(rows, num_groups)](
            x, q, scale, cols, x.stride(0), q.stride(0), *scale.stride(), GROUP=group
        )
    return q, scale


def _block_mm_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tiles (BLOCK_K is the scales' block_k) from ops/gpu/fp8_mm_probe.py at the 27B projections on
    the H200 (runs CD, CF, CG; µs against the 4-stage, one-group tiles before). The kernel waits for
    each group's dot before scaling it, so two groups a loop step (SUB = 2, their dots issued
    together) pay except at the widest N: 64 rows in_proj 25.7 / 27.9, out_proj 18.0 / 20.7, qkv
    24.2 / 25.9, down 45.3 / 55.9 (gate_up 59.3 with one group, 4 stages); 16 rows in_proj 24.5 /
    25.7, qkv 22.8 / 23.5, out_proj 17.9 / 18.7 (32 columns), gate_up 48.3 (one group, 3 stages).
    More stages (6, 8) changed nothing (CF)."""
    if m <= 16:
        if n > 20000:
            return dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=3)
        if n <= 8192:
            return dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=1, num_warps=4, num_stages=4, SUB=2)
        return dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=3, SUB=2)
    if m <= 128:
        # 65-128 rows: the 64-row tiles over two M tiles, paired (GROUP_M = 2) so the second reads
        # each weight block from L2. Run CO timed the generic tiles below at 65 rows 2-6x slower
        # than these at 64 (in_proj 90.0 / 25.7 µs, out_proj 105.8 / 18.0, down 112.2 / 45.3), so
        # two M tiles of them stay faster even if each read the weight from HBM again
        # (not yet timed at 65-128 rows themselves).
        group_m = 1 if m <= 64 else 2
        if n > 20000:
            return dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=group_m, num_warps=4, num_stages=4)
        stages = 4 if k > 5120 else 3
        return dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=group_m, num_warps=4, num_stages=stages, SUB=2)
    return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3)


def fp8_block_mm_triton(
    a_q: torch.Tensor,  # [M, K] e4m3
    a_scale: torch.Tensor,  # [M, ceil(K/bk)] fp32
    b_q: torch.Tensor,  # [N, K] e4m3
    b_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] fp32
    block: Block,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Same result as fp8_block_mm_ref (fp32 accumulation per K block)."""
    check_last_dim_contiguous("a_q", a_q)
    check_last_dim_contiguous("b_q", b_q)
    (m, k), n = a_q.shape, b_q.shape[0]
    block_n, block_k = block
    want_a, want_b = (m, -(-k // block_k)), (-(-n // block_n), -(-k // block_k))
    if b_q.shape[1] != k or tuple(a_scale.shape) != want_a or tuple(b_scale.shape) != want_b:
        raise ValueError(
            f"fp8_block_mm: a {tuple(a_q.shape)} scale {tuple(a_scale.shape)} (want {want_a}), "
            f"b {tuple(b_q.shape)} scale {tuple(b_scale.shape)} (want {want_b}), block {block}"
        )
    cfg = dict(_block_mm_config(m, n, k), BLOCK_K=block_k)
    if block_k > 128:  # the tiles were measured with Qwen's 128-wide groups; wider: one a step
        cfg.pop("SUB", None)
    return launch_fp8_mm(
        a_q, b_q, a_scale.float(), b_scale.float(), out_dtype, bias, cfg, scale_block_n=block_n
    )


# ---------------------------------- cuBLASLt (torch) block GEMM ----------------------------------

# cuBLASLt's DeepSeek recipe (1 x 128 activation groups, 128 x 128 weight blocks; CUDA 12.9+, SM90
# only) through torch.nn.functional.scaled_mm, for more rows than the Triton tiles were tuned for
# (prefill): see `block_mm_route`.
TORCH_BLOCK = (128, 128)
_TORCH_BLOCK_OK: dict[int, bool] = {}


def torch_block_scales(w_scale: torch.Tensor) -> torch.Tensor:
    """A weight's [N/128, K/128] scales in the layout cuBLASLt's 128 x 128 recipe reads: groups
    padded to a multiple of 4, transposed to [L4, N/128] with strides (1, L4) (a view when K/128
    is already a multiple of 4, as at every Qwen3.5 projection)."""
    groups = w_scale.shape[1]
    pad = -groups % 4
    if pad:
        w_scale = torch.nn.functional.pad(w_scale, (0, pad))
    return w_scale.float().t()


def fp8_block_mm_torch(
    x: torch.Tensor,  # [M, K] bf16 / fp16
    weight_q: torch.Tensor,  # [N, K] e4m3, N and K multiples of 128
    weight_scale: torch.Tensor,  # [N/128, K/128]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T with x quantised per token and group of 128 and the 128 x 128-block weight, in one
    cuBLASLt call (rows padded to a multiple of 4, unwritten: each output row reads only its own
    input row, and the padding rows are sliced away)."""
    m = x.shape[0]
    x_q, x_s = per_token_group_quant_triton(x, 128, pad_rows_to=4, scale_column_major=True)
    f = torch.nn.functional
    out = f.scaled_mm(
        x_q,
        weight_q.t(),
        x_s,
        f.ScalingType.BlockWise1x128,
        torch_block_scales(weight_scale),
        f.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )[:m]
    return out + bias if bias is not None else out


def block_route_summary(fp8_gemm: str, cuda: bool) -> str:
    """What block-scaled weights run on, for `appliance backends` (fp8_gemm: its resolved name)."""
    if not cuda:
        return "torch"
    if fp8_gemm in (backends.MIXED_FP8, "torch") and cublaslt_block_ready(torch.device("cuda")):
        return "triton(M<512)+cublaslt-block(M>=512; long K, wide N earlier)"
    return "triton"


def cublaslt_block_ready(device: torch.device) -> bool:
    """Whether cuBLASLt's block recipe runs here (SM90, torch with the scaled_mm API, CUDA 12.9+):
    tried once per device on a 128-wide problem against the reference, outside graph capture
    (Fp8Block.finish asks at weight load)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _TORCH_BLOCK_OK:
        return _TORCH_BLOCK_OK[index]
    if torch.cuda.is_current_stream_capturing():
        return False  # not decided inside a capture (Fp8Block.finish decides at weight load)
    ok = False
    f = torch.nn.functional
    if torch.cuda.get_device_capability(device) == (9, 0) and hasattr(f, "scaled_mm"):
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(8, 256, generator=gen).to(device, torch.bfloat16)
            w_q, w_s = quantize_block_ref(torch.randn(128, 256, generator=gen) * 0.1, TORCH_BLOCK)
            w_q, w_s = w_q.to(device), w_s.to(device)
            got = fp8_block_mm_torch(x, w_q, w_s).float()
            x_q, x_s = per_token_group_quant_ref(x, 128)
            want = fp8_block_mm_ref(x_q, x_s, w_q, w_s, TORCH_BLOCK, torch.float32)
            ok = bool(((got - want).abs().max() <= 2e-2 * want.abs().max()).item())
            if ok:
                log.info("block fp8: cuBLASLt's 128 x 128 block recipe at prefill sizes")
            else:
                log.warning("cuBLASLt block-fp8 GEMM disagrees with the reference: not used")
        except (RuntimeError, NotImplementedError, TypeError, AttributeError) as exc:
            log.info("cuBLASLt block-fp8 GEMM unavailable (%s): Triton at every size", exc)
    _TORCH_BLOCK_OK[index] = ok
    return ok


def cublaslt_block_wins(m: int, n: int, k: int) -> bool:
    """Where cuBLASLt's block recipe beat the Triton block GEMM at the 27B projections on the H200
    (ops/bench/bench_block_mm.py, run CO; µs with the activation quantisation, Triton / cuBLASLt):
    from 512 rows at every projection (in_proj 152 / 144 at 512, 301 / 172 at 1024; gate_up 662 /
    340 at 1024; 1.03-1.95x); over a long reduction (down, K = 17408) from 65 rows (112 / 64); at
    the widest N (gate_up) from 256 (177 / 104). Below those the Triton tiles were faster (in_proj
    at 256: 88 / 106; out_proj at 65-256: 96-113 / 152-163)."""
    if m <= backends.FP8_TRITON_MAX_M:
        return False
    return m >= 512 or k >= 12288 or (m >= 256 and n >= 20000)


def block_mm_route(m: int, n: int, k: int, block: Block, device: torch.device) -> str:
    """Where a block-scaled GEMM of M > 1 rows runs on CUDA: "torch" (cuBLASLt's block recipe)
    where `cublaslt_block_wins`, the fp8 backend is the default mixed one or torch and the recipe
    runs here (128 x 128 blocks, N and K multiples of 128); else "triton"."""
    if (
        cublaslt_block_wins(m, n, k)
        and backends.selected("fp8_gemm") in (backends.MIXED_FP8, "torch")
        and block == TORCH_BLOCK
        and n % 128 == 0
        and k % 128 == 0
        and cublaslt_block_ready(device)
    ):
        return "torch"
    return "triton"


# ------------------------------------------ dispatchers ------------------------------------------


def per_token_group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return per_token_group_quant_triton(x, group)
    return per_token_group_quant_ref(x, group)


def fp8_block_linear(
    x: torch.Tensor,  # [T, K] bf16 / fp16 / fp32
    weight_q: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)]
    block: Block,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """y = x W^T for a block-scaled fp8 weight: activations quantised per token and group of
    block_k, then the block GEMM (on CUDA cuBLASLt's block recipe where `block_mm_route` says so,
    else Triton; the reference elsewhere); one row on CUDA runs the weight-only GEMV of
    appliance_kernels/fp8_gemv.py instead (no activation quantisation)."""
    n, k = weight_q.shape
    if use_triton(x) and gemv_wins(x.shape[0], n, k) and block_gemv_fits(block, n, k):
        return fp8_gemv_block(x, weight_q, weight_scale, block, bias)
    if use_triton(x) and block_mm_route(x.shape[0], n, k, block, x.device) == "torch":
        return fp8_block_mm_torch(x, weight_q, weight_scale, bias)
    x_q, x_scale = per_token_group_quant(x, block[1])
    if use_triton(x):
        if (
            splitk_wins(x.shape[0], weight_q.shape[0], weight_q.shape[1])
            and block[1] == SPLITK_BLOCK_K
            and block[0] % SPLITK_BLOCK_N == 0
        ):
            return fp8_splitk_block_mm(x_q, x_scale, weight_q, weight_scale, block, x.dtype, bias)
        return fp8_block_mm_triton(x_q, x_scale, weight_q, weight_scale, block, x.dtype, bias)
    return fp8_block_mm_ref(x_q, x_scale, weight_q, weight_scale, block, x.dtype, bias)
