"""The Qwen3.5 MTP draft head (dense and MoE): fc over [norm(embed(t+1)) | norm(h_t)], one gated
full-attention decoder layer with its own KV layer, `mtp.norm`. Shares embeddings, lm_head and
rotary with the main model (held by reference, not as parameters). Built by `build_draft_modules`.
"""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.config import TextConfig
from appliance.models.layers.linear import ReplicatedLinear
from appliance.models.layers.norm import RMSNorm
from appliance.models.layers.quant import quant_for
from appliance.models.qwen3_5 import DecoderLayer, map_layer_name

MTP_MODES = ("vanilla", "eagle")


class Qwen3_5MTP(nn.Module):
    def __init__(self, cfg: TextConfig, main: nn.Module) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = ReplicatedLinear(2 * hidden, hidden, quant=quant_for(cfg.quant, "mtp.fc"))
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zero_centered=True)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention", "mtp.layers.0")])
        self.norm = RMSNorm(hidden, eps, zero_centered=True)
        self._main = (main,)  # shared embedding / lm_head / rotary; a tuple keeps it unregistered

    @property
    def main(self) -> nn.Module:
        return self._main[0]

    def forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """next_ids [T] (token t+1), hidden [T, H] (post-norm state at t), positions [T] (t).
        Returns the post-`mtp.norm` state [T, H]; `main.compute_logits` of it predicts token t+2."""
        embeds = self.main.model.embed_tokens(next_ids)
        x = self.fc(
            torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        )
        cos, sin = self.main.rotary(positions)
        h, residual = self.layers[0](x, None, cos, sin)
        h, _ = self.norm(h, residual)
        return h

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """`mtp.*` checkpoint names -> ours; every draft module loads the checkpoint's layer 0."""
        if not name.startswith("mtp."):
            return None
        name = name[len("mtp.") :]
        if name.startswith("layers."):
            rest = name.split(".", 2)[2]
            return map_layer_name(f"layers.0.{rest}", self)
        return name, None


def build_draft_modules(cfg: TextConfig, main: nn.Module, mode: str, step: int) -> list[nn.Module]:
    """vanilla: one module per draft step; eagle: one module reused for every step."""
    if mode not in MTP_MODES:
        raise ValueError(f"mtp_mode: expected one of {', '.join(MTP_MODES)}, got {mode!r}")
    if not 1 <= step <= 3:
        raise ValueError(f"mtp_step: expected 1, 2 or 3, got {step}")
    if cfg.mtp_num_hidden_layers < 1:
        raise ValueError(
            f"{cfg.architecture}: the checkpoint has no MTP head (mtp_num_hidden_layers is 0)"
        )
    count = step if mode == "vanilla" else 1
    return [Qwen3_5MTP(cfg, main) for _ in range(count)]
