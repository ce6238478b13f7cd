"""Helpers of the fp8 checkpoint tests: engine logits of a checkpoint, the fp8 kernels with the
activation quantisation taken out (so an fp8 model must equal its dequantised twin to float noise),
and the dequantised view of a loaded model's fp8 parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from test_qwen3_5_parity import engine_logits

import appliance_kernels.fp8_moe as fp8_moe
from appliance.engine.runner import ModelRunner
from appliance.models.layers import quant_methods
from appliance.offline.llm import build_engine_config
from appliance_kernels.fp8 import FP8_DTYPE
from appliance_kernels.fp8_block import dequantize_block

IDS = list(range(3, 120, 3))


def runner(ckpt, quantization: str = "", **options) -> ModelRunner:
    """A runner built the way `--quantization` builds it (ModelConfig.quantization)."""
    opts = dict(max_num_seqs=2, num_kv_slots=256, max_model_len=128, **options)
    return ModelRunner(build_engine_config(str(ckpt), 1, dict(opts, quantization=quantization)))


def logits(ckpt, quantization: str = "") -> torch.Tensor:
    """Teacher-forced logits [len(IDS), vocab] of IDS, prefilled in chunks of 16."""
    return engine_logits(runner(ckpt, quantization), [IDS], chunk=16)[0]


def _linear_exact(x, weight_q, weight_scale, bias=None):
    w = weight_q.float() * weight_scale.float().reshape(-1, 1)
    return F.linear(x, w.to(x.dtype), bias)


def _block_exact(x, weight_q, weight_scale, block, bias=None):
    return F.linear(x, dequantize_block(weight_q, weight_scale, block).to(x.dtype), bias)


def without_activation_quant(monkeypatch) -> None:
    """fp8 weights dequantised, activations left in full precision (the per-channel expert
    reference, appliance_kernels.moe.fused_moe_fp8_ref, already works this way)."""
    monkeypatch.setattr(quant_methods, "fp8_linear", _linear_exact)
    monkeypatch.setattr(quant_methods, "fp8_block_linear", _block_exact)
    monkeypatch.setattr(fp8_moe, "fp8_block_linear", _block_exact)


def dequantized_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in fp32; fp8 weights multiplied out with their `_scale` (per channel or
    per tile); the scales themselves left out. Names match an unquantised model's."""
    params = dict(model.named_parameters())
    out = {}
    for name, param in params.items():
        if name.endswith("_scale"):
            continue
        if param.dtype != FP8_DTYPE:
            out[name] = param.float()
            continue
        scale = params[name + "_scale"]
        module = model.get_submodule(name.rsplit(".", 1)[0])
        block = module.method.block
        if block is not None:
            out[name] = dequantize_block(param, scale, block)
        else:
            out[name] = param.float() * scale.float()[..., None]
    return out


def exact_everywhere() -> None:
    """without_activation_quant for a spawned TP rank (no pytest monkeypatch there)."""
    quant_methods.fp8_linear = _linear_exact
    quant_methods.fp8_block_linear = _block_exact
    fp8_moe.fp8_block_linear = _block_exact


def tp_rank_main(rank: int, world: int, init: str, ckpt: str, out: str) -> None:
    """One rank of a TP=2 run of `logits(ckpt)` with activation quantisation taken out."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    exact_everywhere()
    config = build_engine_config(ckpt, 1, dict(max_num_seqs=2, num_kv_slots=256, max_model_len=128))
    result = engine_logits(ModelRunner(config, rank, world), [IDS], chunk=16)[0]
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()
