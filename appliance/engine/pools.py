"""Device memory pools on a worker: the token-granular KV pool of the full-attention layers and the
linear-attention state pool (conv + fp32 SSM per request slot) of the GDN layers, bound into the
layers. Sizes come from the runner; the router owns the allocators. Per-request tables (tokens,
`req_to_token`) are in appliance/engine/requests.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from appliance.engine.transfer import to_device
from appliance.logging import get_logger
from appliance.models.layers.attention import Attention
from appliance.models.layers.gdn import GatedDeltaNet
from appliance_kernels.state_commit import commit_states

log = get_logger(__name__)

COMMIT_CHUNK_BYTES = 256 * 2**20  # bound on the temporary of a snapshot copy


@dataclass(frozen=True)
class PoolSizes:
    num_kv_slots: int  # slots the router allocates
    num_req_slots: int
    max_model_len: int
    mtp_step: int = 0  # draft tokens per step; adds candidates, conv windows and scratch KV slots
    padding: bool = False  # one more request row and KV slot for the padding rows of CUDA graphs
    num_snapshot_slots: int = 0  # prefix-cache GDN state snapshots (the router allocates them)

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


def plan_kv_slots(pool_bytes: float, state_bytes: int, per_slot: int, scratch: int) -> int:
    """The startup memory plan's KV slots: the pools' memory (RunnerMemory._pool_bytes) less the
    state pools, in slots of `per_slot` bytes (every attention layer's k and v), less the MTP
    scratch slots."""
    return int((pool_bytes - state_bytes) // max(1, per_slot)) - scratch


def plan_snapshot_slots(
    configured: int,
    max_num_seqs: int,
    per_snapshot: int,
    pool_bytes: float | None,
    fraction: float,
    kv_bytes: int = 0,
) -> int:
    """Prefix-cache state snapshot slots: `configured` when set; else 4 x max_num_seqs, on a GPU
    (`pool_bytes` known) at most `fraction` of the pool memory, and at most what a KV pool of a
    fixed size (`kv_bytes`, --num-kv-slots) leaves of it."""
    if configured:
        return configured
    count = 4 * max_num_seqs
    if pool_bytes is not None:
        room = min(pool_bytes * fraction, pool_bytes - kv_bytes)
        count = min(count, int(room // max(1, per_snapshot)))
    return max(0, count)


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
    """Allocates and binds the KV and state tensors into the model's layers. The GDN layers' state
    tensors are views of one stacked tensor per kind ([layers, slots, ...]; all GDN layers of a
    model have one shape), so committing MTP verify states is a handful of kernels for the whole
    model rather than a handful per layer."""

    def __init__(
        self,
        models: list[nn.Module],
        sizes: PoolSizes,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,  # the KV pools' dtype (fp8 e4m3); None = dtype
    ) -> None:
        self.sizes = sizes
        self.kv_dtype = kv_dtype or dtype
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        modules = [m for model in models for m in model.modules()]
        for m in modules:
            if isinstance(m, Attention):
                shape = (sizes.num_kv_rows, m.num_kv_heads, m.head_dim)
                m.kv_cache = (
                    torch.zeros(shape, dtype=self.kv_dtype, device=device),
                    torch.zeros(shape, dtype=self.kv_dtype, device=device),
                )
                self.kv.append(m.kv_cache)
        self.gdn_layers = [m for m in modules if isinstance(m, GatedDeltaNet)]
        self.stacked: dict[str, torch.Tensor] = {}
        if self.gdn_layers:
            self._bind_states(sizes, dtype, device)
        self.states = [(m.conv_states, m.ssm_states) for m in self.gdn_layers]
        kv_mib = sum(k.numel() * k.element_size() * 2 for k, _ in self.kv) / 2**20
        st_mib = sum(
            t.numel() * t.element_size() for k, t in self.stacked.items() if "snap" not in k
        )
        snap_mib = sum(t.numel() * t.element_size() for k, t in self.stacked.items() if "snap" in k)
        log.info(
            "pools: %d KV slots (%s, %.1f MiB), %d request/state slots (%.1f MiB), %d prefix-cache "
            "state snapshots (%.1f MiB, %.2f MiB each)",
            sizes.num_kv_slots,
            str(self.kv_dtype).removeprefix("torch."),
            kv_mib,
            sizes.num_req_slots,
            st_mib / 2**20,
            sizes.num_snapshot_slots,
            snap_mib / 2**20,
            snap_mib / 2**20 / max(1, sizes.num_snapshot_slots),
        )

    def log_kv_scales(self, models: list[nn.Module]) -> None:
        """With an fp8 KV pool: which k / v scales each attention layer uses (checkpoint or 1.0)."""
        layers = [(n, m) for model in models for n, m in model.named_modules()]
        layers = [(n, m) for n, m in layers if isinstance(m, Attention)]
        from_ckpt = [(n, m) for n, m in layers if m.kv_scales_source.startswith("checkpoint")]
        log.info(
            "fp8 KV cache: k/v scales from the checkpoint for %d of %d attention layers, 1.0 "
            "for the rest",
            len(from_ckpt),
            len(layers),
        )
        for name, m in from_ckpt:
            log.info("fp8 KV cache scales of %s: %s", name, m.kv_scales_source)

    def _bind_states(self, sizes: PoolSizes, dtype: torch.dtype, device: torch.device) -> None:
        first, rows = self.gdn_layers[0], sizes.mtp_step + 1
        shapes = {
            (m.conv_dim, m.conv_kernel, m.num_v_heads, m.head_k_dim, m.head_v_dim)
            for m in self.gdn_layers
        }
        if len(shapes) != 1:
            raise ValueError(f"GDN layers of different shapes cannot share a state pool: {shapes}")
        n, slots = len(self.gdn_layers), sizes.num_req_rows
        heads = (first.num_v_heads, first.head_k_dim, first.head_v_dim)
        width = first.conv_kernel - 1
        kinds = {  # name -> (shape, dtype)
            "conv_states": ((n, slots, first.conv_dim, width), dtype),
            "ssm_states": ((n, slots, *heads), torch.float32),
        }
        if sizes.num_snapshot_slots:  # prefix-cache snapshots of the committed state
            snaps = sizes.num_snapshot_slots
            kinds["conv_snapshots"] = ((n, snaps, first.conv_dim, width), dtype)
            kinds["ssm_snapshots"] = ((n, snaps, *heads), torch.float32)
        if sizes.mtp_step:  # one SSM state per verify row, and the wide conv working slot
            kinds["ssm_candidates"] = ((n, slots, rows, *heads), torch.float32)
            kinds["conv_windows"] = ((n, slots, first.conv_dim, width + rows), dtype)
        for name, (shape, kind) in kinds.items():
            self.stacked[name] = torch.zeros(shape, dtype=kind, device=device)
            if "snapshots" in name:
                continue  # the pool's own: layers never read snapshots
            for i, m in enumerate(self.gdn_layers):
                setattr(m, name, self.stacked[name][i])

    def commit_verify(self, slots: torch.Tensor, accepted_rows: torch.Tensor) -> None:
        """After MTP acceptance, in every GDN layer at once: the state after verify row
        accepted_rows[i] becomes request slots[i]'s committed state (SSM from its candidate, conv
        from the working window), as GatedDeltaNet.commit_verify does for one layer."""
        st = self.stacked
        if not st:
            return
        commit_states(
            st["ssm_states"],
            st["ssm_candidates"],
            st["conv_states"],
            st["conv_windows"],
            slots,
            accepted_rows,
        )

    def save_snapshots(self, req_slots: list[int], snapshots: list[int]) -> None:
        """Prefix cache: request req_slots[i]'s committed GDN state (every layer) into snapshot
        slot snapshots[i]."""
        self._copy_states(req_slots, snapshots, ("conv_states", "ssm_states"), "_snapshots")

    def restore_snapshots(self, snapshots: list[int], req_slots: list[int]) -> None:
        """Prefix-cache hits: snapshot slot snapshots[i] becomes request req_slots[i]'s state."""
        self._copy_states(snapshots, req_slots, ("conv_snapshots", "ssm_snapshots"), "_states")

    def _copy_states(
        self, src: list[int], dst: list[int], kinds: tuple[str, str], to_suffix: str
    ) -> None:
        """stacked[kind][:, dst[i]] = stacked[kind][:, src[i]] for conv and SSM, every layer."""
        if not src or "ssm_snapshots" not in self.stacked:
            return
        device = self.stacked["ssm_states"].device
        src_t = to_device(src, torch.int64, device)  # no stream sync: steps may be in flight
        dst_t = to_device(dst, torch.int64, device)
        for kind in kinds:
            source, target = self.stacked[kind], self.stacked[kind.split("_")[0] + to_suffix]
            # the gathered rows are a temporary: a few layers at a time keeps it near
            # COMMIT_CHUNK_BYTES (one 27B SSM state is ~150 MB over its 48 layers)
            per_layer = len(src) * source[0, 0].numel() * source.element_size()
            step = max(1, COMMIT_CHUNK_BYTES // max(1, per_layer))
            for first in range(0, source.shape[0], step):
                layers = slice(first, first + step)
                target[layers, dst_t] = source[layers, src_t]
