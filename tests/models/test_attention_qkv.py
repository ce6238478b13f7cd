"""The attention layer's fused q/k/v projection (appliance/models/layers/attention.py): it loads a
checkpoint's separate q_proj / k_proj / v_proj tensors (bf16 with biases, fp8 per-channel, fp8
block) into one `qkv_proj` and gives, on every simulated TP rank (kv heads split or replicated),
exactly what three separate column linears give; it falls back to three layers where they cannot
share one weight, and a segment missing from the checkpoint is named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from appliance.models.layers.attention import Attention, kv_head_shard
from appliance.models.layers.linear import ColumnLinear
from appliance.models.layers.parallel import set_tp, tp_size
from appliance.models.layers.quant import QuantConfig
from appliance.models.loader import CheckpointMismatch, load_weights
from appliance.models.qwen3_5 import map_layer_name
from appliance_kernels.fp8 import per_token_quant_ref
from appliance_kernels.fp8_block import quantize_block_ref

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 32
ATTN = "layers.0.self_attn"
O_PROJ = f"{ATTN}.o_proj"  # kept unquantised: these tests are about q / k / v
CHANNEL = QuantConfig("fp8_channel", None, False, (O_PROJ,), "compressed-tensors")
BLOCK16 = QuantConfig("fp8_block", (16, 16), False, (O_PROJ,), "fp8")
BLOCK32 = QuantConfig("fp8_block", (32, 32), False, (O_PROJ,), "fp8")


class OneLayer(nn.Module):
    """An attention layer under its checkpoint name, mapped the way the Qwen models map theirs."""

    def __init__(self, quant, bias: bool, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].self_attn = Attention(
            HIDDEN, heads, kv_heads, head_dim, 1e-6, True, True, bias, quant, prefix=ATTN
        )

    @property
    def attn(self) -> Attention:
        return self.layers[0].self_attn

    def map_weight_name(self, name: str):
        return map_layer_name(name, self)


@pytest.fixture(autouse=True)
def single_rank_after():
    yield
    set_tp(0, 1)


def checkpoint(quant, bias: bool, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM) -> dict:
    """Separate q/k/v (+ o, norms) tensors as checkpoints hold them; fp8 ones with their scales
    under the layout's name (`weight_scale_inv` block, `weight_scale` [N, 1] per channel)."""
    gen = torch.Generator().manual_seed(0)
    rows = {"q_proj": heads * head_dim * 2, "k_proj": kv_heads * head_dim}
    rows["v_proj"] = rows["k_proj"]
    tensors = {}
    for proj, n in rows.items():
        w = torch.randn(n, HIDDEN, generator=gen) / 8
        name = f"{ATTN}.{proj}.weight"
        if quant is None:
            tensors[name] = w.bfloat16()
        elif quant.block is not None:
            tensors[name], tensors[name + "_scale_inv"] = quantize_block_ref(w, quant.block)
        else:
            tensors[name], tensors[name + "_scale"] = per_token_quant_ref(w)
        if bias:
            tensors[f"{ATTN}.{proj}.bias"] = torch.randn(n, generator=gen).bfloat16()
    tensors[f"{ATTN}.o_proj.weight"] = torch.randn(HIDDEN, heads * head_dim, generator=gen)
    tensors[f"{ATTN}.q_norm.weight"] = torch.zeros(head_dim)
    tensors[f"{ATTN}.k_norm.weight"] = torch.zeros(head_dim)
    return tensors


def separate_linears(tensors, quant, bias, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    """The three column linears the layer used to build, loaded straight from the tensors."""
    q_out, kv_out = heads * head_dim * 2, kv_heads * head_dim
    local_kv = [max(1, kv_heads // tp_size()) * head_dim]
    shard = kv_head_shard(kv_heads, head_dim)
    layers = {
        "q_proj": ColumnLinear(HIDDEN, [q_out], bias=bias, quant=quant),
        "k_proj": ColumnLinear(HIDDEN, [kv_out], bias, local_kv, shard, quant),
        "v_proj": ColumnLinear(HIDDEN, [kv_out], bias, local_kv, shard, quant),
    }
    for proj, layer in layers.items():
        for param_name, param in layer.named_parameters():
            suffix = param_name.replace("weight_scale", "weight_scale_inv")
            key = next(
                k
                for k in (f"{ATTN}.{proj}.{param_name}", f"{ATTN}.{proj}.{suffix}")
                if k in tensors
            )
            param.weight_loader(param, tensors[key], None)
    return layers


def loaded_layer(tensors, quant, bias, **sizes) -> Attention:
    model = OneLayer(quant, bias, **sizes)
    load_weights(model, iter(tensors.items()))
    return model.attn


@pytest.mark.parametrize("tp", [1, 2, 4])  # 4 > 2 kv heads: each kv head on two ranks
@pytest.mark.parametrize(
    "quant,bias", [(None, True), (CHANNEL, False), (BLOCK16, False)], ids=["bf16", "ch", "blk"]
)
def test_fused_qkv_equals_three_linears_on_every_rank(quant, bias, tp):
    tensors = checkpoint(quant, bias)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    for rank in range(tp):
        set_tp(rank, tp)
        attn = loaded_layer(tensors, quant, bias)
        assert attn.qkv_proj is not None and not hasattr(attn, "k_proj")
        kv_local = max(1, KV_HEADS // tp) * HEAD_DIM
        assert attn.qkv_proj.weight.shape == (HEADS * HEAD_DIM * 2 // tp + 2 * kv_local, HIDDEN)
        if quant is not None:
            assert attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        separate = separate_linears(tensors, quant, bias)
        for proj, got in zip(("q_proj", "k_proj", "v_proj"), attn.project_qkv(x)):
            torch.testing.assert_close(got, separate[proj](x), atol=0, rtol=0, msg=proj)


def test_fused_rows_are_the_ranks_heads():
    """Independently of the shard fns: rank r's k rows are its kv head's rows of k_proj (tp 4:
    ranks 0, 1 hold head 0; 2, 3 head 1) and its q rows its quarter of q_proj."""
    tensors = checkpoint(None, False)
    full = {p: tensors[f"{ATTN}.{p}.weight"].float() for p in ("q_proj", "k_proj", "v_proj")}
    x = torch.randn(3, HIDDEN)
    for rank in range(4):
        set_tp(rank, 4)
        q, k, v = loaded_layer(tensors, None, False).project_qkv(x)
        head = rank // 2
        kv_rows = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
        q_rows = slice(rank * 64, (rank + 1) * 64)
        torch.testing.assert_close(q, F.linear(x, full["q_proj"][q_rows]))
        torch.testing.assert_close(k, F.linear(x, full["k_proj"][kv_rows]))
        torch.testing.assert_close(v, F.linear(x, full["v_proj"][kv_rows]))


def test_mixed_quantization_keeps_three_layers():
    """k_proj on the ignore list: q and v fp8, k unquantised cannot share one GEMM."""
    ignore = (O_PROJ, f"{ATTN}.k_proj")
    quant = QuantConfig("fp8_channel", None, False, ignore, "compressed-tensors")
    tensors = checkpoint(quant, False)
    key = f"{ATTN}.k_proj.weight"
    tensors[key] = (tensors[key].float() * tensors.pop(key + "_scale")).bfloat16()
    attn = loaded_layer(tensors, quant, False)
    assert attn.qkv_proj is None
    assert attn.q_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.k_proj.weight.dtype == torch.float32
    x = torch.randn(4, HIDDEN)
    q, k, _ = attn.project_qkv(x)
    torch.testing.assert_close(k, F.linear(x, tensors[key].float()))
    assert q.shape == (4, HEADS * HEAD_DIM * 2)


def test_block_scales_straddling_segments_keep_three_layers():
    """head_dim 16 with 32-row blocks: v would start mid-block in a fused weight."""
    quant = BLOCK32
    sizes = dict(heads=4, kv_heads=1, head_dim=16)
    tensors = checkpoint(quant, False, **sizes)
    attn = loaded_layer(tensors, quant, False, **sizes)
    assert attn.qkv_proj is None
    x = torch.randn(4, HIDDEN)
    separate = separate_linears(tensors, quant, False, **sizes)
    for proj, got in zip(("q_proj", "k_proj", "v_proj"), attn.project_qkv(x)):
        torch.testing.assert_close(got, separate[proj](x), atol=0, rtol=0, msg=proj)


def test_replicated_kv_head_off_block_boundary_is_refused():
    """tp 4 over 2 kv heads of 16 rows, 32-row blocks: rank 2's head starts mid-block."""
    quant = BLOCK32
    sizes = dict(heads=4, kv_heads=2, head_dim=16)
    tensors = checkpoint(quant, False, **sizes)
    set_tp(2, 4)
    with pytest.raises(CheckpointMismatch, match="block_n = 32 boundaries"):
        loaded_layer(tensors, quant, False, **sizes)


def test_missing_segment_is_named():
    tensors = checkpoint(CHANNEL, False)
    del tensors[f"{ATTN}.v_proj.weight"], tensors[f"{ATTN}.v_proj.weight_scale"]
    with pytest.raises(CheckpointMismatch, match=r"missing keys: .*self_attn\.v_proj\.weight\b"):
        loaded_layer(tensors, CHANNEL, False)


def test_kv_cache_scales_reach_the_fused_layer():
    """`self_attn.k_scale` is a KV-cache scale, `k_proj.weight_scale` a weight scale."""
    tensors = checkpoint(CHANNEL, False)
    tensors[f"{ATTN}.k_scale"] = torch.tensor(0.5)
    tensors[f"{ATTN}.v_scale"] = torch.tensor(0.25)
    attn = loaded_layer(tensors, CHANNEL, False)
    assert attn.kv_scales_host == (0.5, 0.25)
    k_rows = slice(HEADS * HEAD_DIM * 2, (HEADS * 2 + KV_HEADS) * HEAD_DIM)
    want = tensors[f"{ATTN}.k_proj.weight_scale"].reshape(-1)
    torch.testing.assert_close(attn.qkv_proj.weight_scale[k_rows], want)
