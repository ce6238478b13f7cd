"""The Qwen3-VL / Qwen3.5 vision transformer as plain nn.Modules (names as `model.visual.*`).

Built and driven by `visual.encoder.VisionEncoder`. One forward takes the packed patches of several
images; attention never crosses an image boundary. Qwen3-VL adds deepstack mergers (Qwen3.5: none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 27  # transformer blocks
    hidden_size: int = 1152  # ViT width
    intermediate_size: int = 4304  # block MLP width
    num_heads: int = 16  # attention heads
    in_channels: int = 3  # image channels
    patch_size: int = 16  # patch side in pixels
    temporal_patch_size: int = 2  # frames per patch
    spatial_merge_size: int = 2  # side of the window merged into one output token
    out_hidden_size: int = 4096  # merger output width = LLM hidden size
    num_position_embeddings: int = 2304  # learned position table (a square grid)
    hidden_act: str = "gelu_pytorch_tanh"  # block MLP activation
    deepstack_visual_indexes: tuple[int, ...] = ()  # blocks whose output feeds a deepstack merger
    rope_theta: float = 10000.0  # base of the 2-D rotary embedding

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size: expected a multiple of num_heads")
        if (self.hidden_size // self.num_heads) % 4:
            raise ValueError("num_heads: head_dim must be a multiple of 4 for the 2-D rotary")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act: expected one of {', '.join(_ACTIVATIONS)}")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError("num_position_embeddings: expected a square number")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(
                f"deepstack_visual_indexes: expected block indexes in [0, {self.depth})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, vision_config: dict) -> VisionConfig:
        """From the `vision_config` dict of a Qwen3-VL / Qwen3.5 `config.json`."""
        known = {
            name: vision_config[name] for name in cls.__dataclass_fields__ if name in vision_config
        }
        known["deepstack_visual_indexes"] = tuple(
            vision_config.get("deepstack_visual_indexes") or ()
        )
        rope = vision_config.get("rope_parameters") or {}
        known["rope_theta"] = float(
            rope.get("rope_theta", vision_config.get("rope_theta", 10000.0))
        )
        return cls(**known)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim]; cos/sin [tokens, head_dim]; rotation computed in fp32."""
    x32 = x.float()
    rotated = x32 * cos[:, None, :] + _rotate_half(x32) * sin[:, None, :]
    return rotated.to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, seq_lens: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim)  # [T, 3, H, D]
        q, k, v = qkv.unbind(1)  # each [T, H, D]
        q = apply_vision_rotary(q, cos, sin)
        k = apply_vision_rotary(k, cos, sin)
        outputs = []
        # One SDPA call per image: bidirectional inside an image, nothing across images. The inputs
        # are 4-D [1, H, L, D]: torch sends only 4-D inputs to its fused (flash / memory-efficient)
        # kernels; 3-D ones take the math path, which materialises [H, L, L] fp32 scores (256 GiB
        # for one 16k-patch-side image).
        for q_img, k_img, v_img in zip(
            q.split(seq_lens), k.split(seq_lens), v.split(seq_lens), strict=True
        ):
            out = F.scaled_dot_product_attention(
                q_img.transpose(0, 1)[None],
                k_img.transpose(0, 1)[None],
                v_img.transpose(0, 1)[None],
            )  # [1, H, L, D]
            outputs.append(out[0].transpose(0, 1))
        attn = torch.cat(outputs, dim=0).reshape(tokens, -1)  # [T, hidden]
        return self.proj(attn)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, seq_lens: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), seq_lens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2x2 window -> one token: LayerNorm, Linear(4h, 4h), exact GELU, Linear(4h, out).
    `postshuffle_norm` (deepstack mergers) normalises the joined 4h vector, not each h."""

    def __init__(self, config: VisionConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.window_dim = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        norm_dim = self.window_dim if postshuffle_norm else config.hidden_size
        self.norm = nn.LayerNorm(norm_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.window_dim, self.window_dim)
        self.linear_fc2 = nn.Linear(self.window_dim, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [patches, hidden]; the 4 patches of a window are consecutive rows
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.window_dim))
        else:
            x = self.norm(x).view(-1, self.window_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # [patches / 4, out_hidden]


class PatchEmbed(nn.Module):
    """Conv3d with stride == kernel over one patch is a matmul; weight keeps Conv3d shape."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv3d(
            config.in_channels,
            config.hidden_size,
            kernel_size=(config.temporal_patch_size, config.patch_size, config.patch_size),
            stride=(config.temporal_patch_size, config.patch_size, config.patch_size),
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values [patches, C*T*P*P] in (C, T, P, P) order -> [patches, hidden]
        weight = self.proj.weight.view(self.proj.weight.shape[0], -1)
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


def _window_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """[h, w, ...] raster grid -> [h*w, ...] rows in merge-window order (the pixel_values order)."""
    h, w = grid.shape[:2]
    grid = grid.reshape(h // merge, merge, w // merge, merge, *grid.shape[2:])
    return grid.transpose(1, 2).reshape(h * w, *grid.shape[4:])


class QwenVisionTransformer(nn.Module):
    """Parameter names match the checkpoint under `model.visual.`."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, postshuffle_norm=True) for _ in config.deepstack_visual_indexes
        )

    def position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Learned table bilinearly resized (align_corners) per image -> [patches, hidden]."""
        side = math.isqrt(self.config.num_position_embeddings)
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1)[None]  # [1, hid, S, S]
        merge = self.config.spatial_merge_size
        pieces = []
        for t, h, w in grids:
            resized = F.interpolate(
                table.float(), size=(h, w), mode="bilinear", align_corners=True
            )  # [1, hid, h, w]
            rows = _window_order(resized[0].permute(1, 2, 0), merge)  # [h*w, hid]
            pieces.append(rows.repeat(t, 1))
        return torch.cat(pieces).to(self.pos_embed.weight.dtype)

    def rotary(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D rotary: first half of each head turns with the row, second half with the column."""
        merge = self.config.spatial_merge_size
        device = self.pos_embed.weight.device
        # fp32 always (a buffer would be cast to bf16 with the module)
        spatial_dim = self.config.head_dim // 2
        exponents = (
            torch.arange(0, spatial_dim, 2, dtype=torch.float32, device=device) / spatial_dim
        )
        inv_freq = 1.0 / (self.config.rope_theta**exponents)  # [head_dim / 4]
        pieces = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device)[:, None].expand(h, w)
            cols = torch.arange(w, device=device)[None, :].expand(h, w)
            coords = _window_order(torch.stack((rows, cols), dim=-1), merge)  # [h*w, 2]
            pieces.append(coords.repeat(t, 1))
        coords = torch.cat(pieces).float()  # [patches, 2]
        angles = coords[:, :, None] * inv_freq  # [patches, 2, head_dim / 4]
        angles = angles.flatten(1)  # [patches, head_dim / 2]: row freqs then column freqs
        angles = torch.cat((angles, angles), dim=-1)  # [patches, head_dim]
        return angles.cos(), angles.sin()

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [patches, C*T*P*P], grid_thw [images, 3] ->
        (embeds [patches / merge^2, out_hidden], list with one such tensor per deepstack merger)."""
        grids = [
            tuple(int(v) for v in row)
            for row in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)
        ]
        merge = self.config.spatial_merge_size
        if any(h % merge or w % merge for _, h, w in grids):
            raise ValueError(f"grid_thw {grids}: h and w must be multiples of {merge}")
        # Each frame of each image is its own attention segment (t = 1 for images).
        seq_lens = [h * w for t, h, w in grids for _ in range(t)]
        if sum(seq_lens) != pixel_values.shape[0]:
            raise ValueError(
                f"grid_thw covers {sum(seq_lens)} patches "
                f"but pixel_values has {pixel_values.shape[0]}"
            )
        x = self.patch_embed(pixel_values) + self.position_embeddings(grids)  # [patches, hidden]
        cos, sin = self.rotary(grids)
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, seq_lens, cos, sin)
            if index in self.config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[
                    self.config.deepstack_visual_indexes.index(index)
                ]
                deepstack.append(merger(x))
        return self.merger(x), deepstack
