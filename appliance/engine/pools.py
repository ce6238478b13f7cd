"""Device memory pools on a worker: the token-granular KV pool of the full-attention layers, the
linear-attention state pool (conv + fp32 SSM per request slot) of the GDN layers, and the per-request
tables (`req_to_token`, token ids). Sizes come from the runner; the router owns the allocators."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from appliance.logging import get_logger
from appliance.models.layers.attention import Attention
from appliance.models.layers.gdn import GatedDeltaNet

log = get_logger(__name__)


@dataclass(frozen=True)
class PoolSizes:
    num_kv_slots: int
    num_req_slots: int
    max_model_len: int


def kv_bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    per = 0
    for m in model.modules():
        if isinstance(m, Attention):
            per += 2 * m.num_kv_heads * m.head_dim * torch.empty((), dtype=dtype).element_size()
    return per


def state_bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    per = 0
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            conv = m.conv_dim * (m.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
            ssm = m.num_v_heads * m.head_k_dim * m.head_v_dim * 4
            per += conv + ssm
    return per


class Pools:
    """Allocates and binds the KV and state tensors into the model's layers."""

    def __init__(self, model: nn.Module, sizes: PoolSizes, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.sizes = sizes
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.states: list[tuple[torch.Tensor, torch.Tensor]] = []
        for m in model.modules():
            if isinstance(m, Attention):
                shape = (sizes.num_kv_slots, m.num_kv_heads, m.head_dim)
                m.kv_cache = (torch.zeros(shape, dtype=dtype, device=device),
                              torch.zeros(shape, dtype=dtype, device=device))
                self.kv.append(m.kv_cache)
            elif isinstance(m, GatedDeltaNet):
                m.conv_states = torch.zeros(sizes.num_req_slots, m.conv_dim, m.conv_kernel - 1,
                                            dtype=dtype, device=device)
                m.ssm_states = torch.zeros(sizes.num_req_slots, m.num_v_heads, m.head_k_dim,
                                           m.head_v_dim, dtype=torch.float32, device=device)
                self.states.append((m.conv_states, m.ssm_states))
        # Written before read (positions < seq_len only), so left uninitialised: with a long context
        # the untouched tail never costs memory on the host.
        self.req_to_token = torch.empty(sizes.num_req_slots, sizes.max_model_len, dtype=torch.int32,
                                        device=device)
        self.token_ids = torch.empty(sizes.num_req_slots, sizes.max_model_len + 1,
                                     dtype=torch.int64, device=device)
        kv_mib = sum(k.numel() * k.element_size() * 2 for k, _ in self.kv) / 2**20
        st_mib = sum(c.numel() * c.element_size() + s.numel() * 4 for c, s in self.states) / 2**20
        log.info("pools: %d KV slots (%.1f MiB), %d request/state slots (%.1f MiB)",
                 sizes.num_kv_slots, kv_mib, sizes.num_req_slots, st_mib)
