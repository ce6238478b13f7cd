"""Device memory pools on a worker: the token-granular KV pool of the full-attention layers and the
linear-attention state pool (conv + fp32 SSM per request slot) of the GDN layers, bound into the
layers. Sizes come from the runner; the router owns the allocators. Per-request tables (tokens,
`req_to_token`) are in appliance/engine/requests.py."""

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
    num_kv_slots: int  # slots the router allocates
    num_req_slots: int
    max_model_len: int
    mtp_step: int = 0  # draft tokens per step; adds candidates, conv windows and scratch KV slots
    padding: bool = False  # one more request row and KV slot for the padding rows of CUDA graphs

    @property
    def num_req_rows(self) -> int:
        """Request rows allocated: the router's slots, then the padding slot."""
        return self.num_req_slots + int(self.padding)

    @property
    def pad_req_slot(self) -> int:
        """Request slot of a CUDA graph's padding rows (never handed out by the router)."""
        return self.num_req_slots

    @property
    def num_kv_rows(self) -> int:
        """KV rows allocated: the router's slots, the MTP scratch slots, then the padding slot."""
        return self.num_kv_slots + self.num_scratch_slots + int(self.padding)

    @property
    def pad_kv_slot(self) -> int:
        return self.num_kv_slots + self.num_scratch_slots

    @property
    def num_scratch_slots(self) -> int:
        """Eagle chain steps after the first write their draft KV here, never into verify slots
        (the padding row has its own, so padded chain rows stay in bounds)."""
        return self.num_req_rows * self.mtp_step

    def scratch_slot(self, req_slot, step: int):  # req_slot: an int or a tensor of them
        return self.num_kv_slots + req_slot * self.mtp_step + step


def kv_bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    per = 0
    for m in model.modules():
        if isinstance(m, Attention):
            per += 2 * m.num_kv_heads * m.head_dim * torch.empty((), dtype=dtype).element_size()
    return per


def state_bytes_per_slot(model: nn.Module, dtype: torch.dtype, mtp_step: int = 0) -> int:
    per = 0
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            # committed state, plus with MTP the wide conv window and one SSM candidate per row
            rows = mtp_step + 1 if mtp_step else 0
            width = (m.conv_kernel - 1) + (m.conv_kernel - 1 + rows if rows else 0)
            conv = m.conv_dim * width * torch.empty((), dtype=dtype).element_size()
            ssm = m.num_v_heads * m.head_k_dim * m.head_v_dim * 4 * (1 + rows)
            per += conv + ssm
    return per


class Pools:
    """Allocates and binds the KV and state tensors into the model's layers."""

    def __init__(
        self, models: list[nn.Module], sizes: PoolSizes, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.sizes = sizes
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.states: list[tuple[torch.Tensor, torch.Tensor]] = []
        rows = sizes.mtp_step + 1
        modules = [m for model in models for m in model.modules()]
        for m in modules:
            if isinstance(m, Attention):
                shape = (sizes.num_kv_rows, m.num_kv_heads, m.head_dim)
                m.kv_cache = (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
                self.kv.append(m.kv_cache)
            elif isinstance(m, GatedDeltaNet):
                m.conv_states = torch.zeros(
                    sizes.num_req_rows, m.conv_dim, m.conv_kernel - 1, dtype=dtype, device=device
                )
                m.ssm_states = torch.zeros(
                    sizes.num_req_rows,
                    m.num_v_heads,
                    m.head_k_dim,
                    m.head_v_dim,
                    dtype=torch.float32,
                    device=device,
                )
                self.states.append((m.conv_states, m.ssm_states))
                if sizes.mtp_step:
                    m.ssm_candidates = torch.zeros(
                        sizes.num_req_rows,
                        rows,
                        m.num_v_heads,
                        m.head_k_dim,
                        m.head_v_dim,
                        dtype=torch.float32,
                        device=device,
                    )
                    m.conv_windows = torch.zeros(
                        sizes.num_req_rows,
                        m.conv_dim,
                        m.conv_kernel - 1 + rows,
                        dtype=dtype,
                        device=device,
                    )
        self.gdn_layers = [m for m in modules if isinstance(m, GatedDeltaNet)]
        kv_mib = sum(k.numel() * k.element_size() * 2 for k, _ in self.kv) / 2**20
        st_mib = sum(c.numel() * c.element_size() + s.numel() * 4 for c, s in self.states) / 2**20
        log.info(
            "pools: %d KV slots (%.1f MiB), %d request/state slots (%.1f MiB)",
            sizes.num_kv_slots,
            kv_mib,
            sizes.num_req_slots,
            st_mib,
        )
