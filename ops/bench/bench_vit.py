"""ViT benchmark (issue "Vision", acceptance point b): preprocessing ms per image and vision-tower
images/s, ours against transformers on the same images, as ratios (HF time / ours; > 1 = ours
faster).

Real-size Qwen3.5-27B vision tower (models.md real-config table) with random weights, bf16 on CUDA;
the transformers tower (`Qwen3_5VisionModel`, attn_implementation sdpa) gets the same weights
(our state dict: parameter names are the checkpoint's `model.visual.*` names in both); the relative
difference of the two outputs is reported. The SDPA backend our attention runs on is printed.
Preprocessing: ours = the visual server's path (`decode_image` + `preprocess_image`) on JPEG
bytes; transformers = `Image.open` + the Qwen2-VL image processor our parity tests compare
against (PIL backend; "exact" = bit-identical pixel values) and, where importable, the torchvision
("fast") one, on CPU and on CUDA.
Images: noise photos (random low-frequency field plus grain) at 640x480, 1280x720, 1920x1080 and
a 6000x4000 photo that smart_resize brings down to the maximum pixel budget. Each size prints its
RESULT line as it finishes; a size that fails (OOM included) says so and the run goes on.

  python ops/bench/bench_vit.py --json vit.json        # CUDA, ~1.5 min
  python ops/bench/bench_vit.py --smoke                # CPU, tiny tower and images, seconds

Also holds the helpers ops/gpu/check_vision.py shares (checkpoint folder, images).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# Pillow, httpx (visual.image_io) and msgspec (appliance.messages) may be missing on the GPU
# machine: say so in one line instead of a traceback.
_MISSING = [
    name
    for name, module in (("pillow", "PIL"), ("httpx", "httpx"), ("msgspec", "msgspec"))
    if importlib.util.find_spec(module) is None
]
if _MISSING:
    print(f"FAIL: missing Python packages {', '.join(_MISSING)} (install their wheels first)")
    raise SystemExit(2)

from PIL import Image  # noqa: E402

from appliance.testing.tiny_vl import TINY_MAX_PIXELS, TINY_MIN_PIXELS  # noqa: E402
from appliance.testing.tiny_vl import TINY_VISION as TINY_VL_VISION  # noqa: E402
from visual.image_io import ImageLimits, decode_image  # noqa: E402
from visual.preprocess import PreprocessConfig, preprocess_image, smart_resize  # noqa: E402

TEXT_CONFIG = ROOT / "ops/bench/configs/qwen3_5_27b.json"
GIB = 2**30

# models.md, real configs: the Qwen3.5-27B vision_config (Qwen3.5-35B-A3B has the same tower)
QWEN3_5_27B_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=5120,
    num_position_embeddings=2304,
    hidden_act="gelu_pytorch_tanh",
    deepstack_visual_indexes=[],
)
REAL_PIXELS = (65536, 16777216)  # preprocessor shortest_edge / longest_edge (models.md §4.1)

# models.md §7.3 tiny tower (the test checkpoints' own), for --smoke
TINY_VISION = dict(TINY_VL_VISION, deepstack_visual_indexes=[])
TINY_PIXELS = (TINY_MIN_PIXELS, TINY_MAX_PIXELS)
TINY_TEXT = dict(
    model_type="qwen3_5_text",
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    vocab_size=2000,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
    eos_token_id=1999,
)
# Qwen3.5 vocabulary ids (models.md real-config table)
SPECIAL_IDS = dict(
    image_token_id=248056,
    video_token_id=248057,
    vision_start_token_id=248053,
    vision_end_token_id=248054,
)

# (width, height, label) of the benchmark images; the last one is the max-size case
REAL_SIZES = [(640, 480, "640x480"), (1280, 720, "1280x720"), (1920, 1080, "1920x1080")]
REAL_SIZES.append((6000, 4000, "6000x4000 (max)"))
TINY_SIZES = [(64, 48, "64x48"), (128, 72, "128x72"), (200, 113, "200x113")]
TINY_SIZES.append((256, 256, "256x256 (max)"))


# ------------------------------------------------------------------------------ shared helpers


def write_checkpoint(out_dir: str | Path, smoke: bool) -> Path:
    """A checkpoint folder without weights: config.json (Qwen3.5-27B text config of
    ops/bench/configs plus the real vision_config; tiny ones for --smoke) and
    preprocessor_config.json with the real (tiny) pixel range."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = json.loads(TEXT_CONFIG.read_text())
    vision = TINY_VISION if smoke else QWEN3_5_27B_VISION
    if smoke:
        raw["text_config"] = dict(TINY_TEXT)
    raw["vision_config"] = dict(vision, model_type="qwen3_5_vision")
    raw.update(SPECIAL_IDS)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=1))
    min_pixels, max_pixels = TINY_PIXELS if smoke else REAL_PIXELS
    preprocessor = {
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255,
        "resample": 3,
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))
    return out_dir


def make_photo(width: int, height: int, seed: int) -> Image.Image:
    """A noise 'photo': a random low-frequency colour field plus fine grain (so JPEG sizes are
    photo-like, well inside max_image_bytes even at 24 MP)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 24), max(2, width // 24), 3), dtype=np.uint8)
    base = Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)
    grain = rng.integers(-6, 7, (height, width, 3), dtype=np.int16)
    pixels = np.clip(np.asarray(base, dtype=np.int16) + grain, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def encode_image(image: Image.Image, max_bytes: int) -> bytes:
    """JPEG bytes (quality lowered until they fit `max_bytes`); PNG past JPEG's 65500 px side."""
    fmt = "JPEG" if max(image.size) <= 65500 else "PNG"
    for quality in (90, 80, 65, 50, 30):
        buf = io.BytesIO()
        image.save(buf, format=fmt, quality=quality)
        if buf.tell() <= max_bytes:
            return buf.getvalue()
    raise ValueError(f"{image.size} image does not fit in {max_bytes} bytes")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def environment(device: torch.device) -> dict:
    import PIL
    import transformers

    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, warmup: int, iters: int, budget_s=10.0):
    """(median seconds, last result) of synchronised calls after warm-up; a slow call (the first
    warm-up is timed) cuts the rest of the warm-up and the iterations to fit about `budget_s`."""
    first = None
    for i in range(warmup):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i == 0:
            first = time.perf_counter() - start
            if first * (warmup + iters) > budget_s:
                break
    if first is not None:
        iters = max(1, min(iters, int(budget_s / max(first, 1e-9))))
    times, result = [], None
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


# ------------------------------------------------------------------------------ attention backend


_BACKENDS = (
    ("flash_attention_for_cpu", "flash (cpu)"),
    ("cudnn", "cudnn"),
    ("efficient", "memory-efficient"),
    ("flash", "flash"),
    ("math", "math (L x L scores)"),
)


@torch.inference_mode()
def attention_backend(encoder) -> str:
    """The SDPA backend our first block's attention runs on (from the profiler's aten op names)."""
    from torch.profiler import ProfilerActivity, profile

    block = encoder.tower.blocks[0]
    tokens, head_dim = 64, encoder.config.head_dim
    x = torch.randn(tokens, encoder.config.hidden_size, device=encoder.device, dtype=encoder.dtype)
    cos = torch.ones(tokens, head_dim, device=encoder.device)
    sin = torch.zeros(tokens, head_dim, device=encoder.device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        block.attn(x, [tokens], cos, sin)
        sync(encoder.device)
    names = [e.key for e in prof.key_averages() if "_scaled_dot_product_" in e.key]
    for key, label in _BACKENDS:
        if any(key in name for name in names):
            return label
    return "unknown: " + ", ".join(names)


# ------------------------------------------------------------------------------ transformers side


def _hf_processor_kwargs(config: PreprocessConfig) -> dict:
    return dict(
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.merge_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
    )


def hf_image_processors(config: PreprocessConfig) -> tuple[dict[str, object], dict[str, str]]:
    """({"pil": processor, "fast": processor}, {kind: why it is unavailable}). transformers 5.x
    has had the PIL one as `Qwen2VLImageProcessorPil` (torchvision one: `Qwen2VLImageProcessor`)
    and, earlier, as `Qwen2VLImageProcessor` (torchvision one: `Qwen2VLImageProcessorFast`)."""
    base = "transformers.models.qwen2_vl."
    candidates = [
        ("pil", base + "image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
        ("fast", base + "image_processing_qwen2_vl_fast", "Qwen2VLImageProcessorFast"),
        (None, base + "image_processing_qwen2_vl", "Qwen2VLImageProcessor"),
    ]
    found: dict[str, object] = {}
    missing: dict[str, str] = {}
    for kind, module, name in candidates:
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception as exc:  # absent module, or torchvision missing
            if kind is not None:
                missing.setdefault(kind, f"{name}: {type(exc).__name__}: {exc}"[:160])
            else:
                missing.setdefault("fast", f"{name}: {type(exc).__name__}: {exc}"[:160])
            continue
        if kind is None:
            mro = " ".join(c.__name__ for c in cls.__mro__)
            kind = "fast" if ("Torchvision" in mro or "Fast" in mro) else "pil"
        if kind not in found:
            try:
                found[kind] = cls(**_hf_processor_kwargs(config))
            except Exception as exc:
                missing[kind] = f"{name}(...): {type(exc).__name__}: {exc}"[:160]
    for kind in found:
        missing.pop(kind, None)
    return found, missing


def hf_vision_tower(vision: dict, state: dict, device: torch.device, dtype: torch.dtype):
    """transformers' Qwen3.5 vision tower (sdpa) on `device`, loaded with our tower's weights."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    keys = (
        "depth hidden_size hidden_act intermediate_size num_heads in_channels patch_size "
        "spatial_merge_size temporal_patch_size out_hidden_size num_position_embeddings"
    ).split()
    config = Qwen3_5VisionConfig(**{k: vision[k] for k in keys})
    with torch.device(device):
        try:
            model = Qwen3_5VisionModel._from_config(config, attn_implementation="sdpa", dtype=dtype)
        except TypeError:  # older signature
            config._attn_implementation = "sdpa"
            model = Qwen3_5VisionModel(config).to(dtype)
    model = model.to(device=device, dtype=dtype).eval()
    params = dict(model.named_parameters())
    if set(params) != set(state):
        raise RuntimeError(
            "HF vision tower parameters differ from ours: "
            f"only HF {sorted(set(params) - set(state))[:5]}, "
            f"only ours {sorted(set(state) - set(params))[:5]}"
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])
    return model


def hf_embeds(out) -> torch.Tensor:
    """The merged embeddings from whatever the HF tower returns (5.x: pooler_output)."""
    if torch.is_tensor(out):
        return out
    if getattr(out, "pooler_output", None) is not None:
        return out.pooler_output
    return out[0]


# ------------------------------------------------------------------------------ the benchmark


def error_text(exc: BaseException, limit: int = 160) -> str:
    if is_oom(exc):  # keep the allocator's numbers: "Tried to allocate X; Y free; Z reserved"
        return "OOM: " + " ".join(str(exc).split())[: max(limit, 400)]
    return f"{type(exc).__name__}: {exc}"[:limit]


def release(device: torch.device) -> None:
    """Give cached blocks back after a failure (call outside the except block: its frames hold
    the failed call's tensors)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


_PREP_IMPLS = (
    ("hf_pil", "hf-pil"),
    ("hf_fast_cpu", "hf-fast-cpu"),
    ("hf_fast_cuda", "hf-fast-cuda"),
)


def preprocess_impls(processors: dict, limits, config, device) -> dict[str, Callable]:
    impls: dict[str, Callable[[bytes], object]] = {
        "ours": lambda d: preprocess_image(decode_image(d, limits), config),
    }
    if "pil" in processors:
        proc = processors["pil"]
        impls["hf_pil"] = lambda d, p=proc: p(
            images=[Image.open(io.BytesIO(d))], return_tensors="np"
        )
    if "fast" in processors:
        proc = processors["fast"]
        impls["hf_fast_cpu"] = lambda d, p=proc: p(
            images=[Image.open(io.BytesIO(d))], return_tensors="pt"
        )
        if device.type == "cuda":
            impls["hf_fast_cuda"] = lambda d, p=proc: p(
                images=[Image.open(io.BytesIO(d))], return_tensors="pt", device=str(device)
            )
    return impls


def preprocess_one(size, impls, config, limits, device, n_images, seed) -> tuple[dict, object]:
    """One image size: ms per image of every implementation (median over n_images distinct JPEGs,
    decode included), HF's agreement with ours; (row, ours' (pixel_values, grid) or None)."""
    width, height, label = size
    resized = smart_resize(height, width, config)
    row: dict = {
        "image": label,
        "width": width,
        "height": height,
        "resized": f"{resized[1]}x{resized[0]}",
        "patches": resized[0] * resized[1] // config.patch_size**2,
    }
    try:
        n = max(1, n_images if width * height < 4_000_000 else min(n_images, 3))
        datas = [
            encode_image(make_photo(width, height, seed + i), limits.max_bytes) for i in range(n)
        ]
    except Exception as exc:
        row["error"] = f"making the images: {error_text(exc)}"
        return row, None
    row.update(n_images=n, jpeg_kb=round(sum(len(d) for d in datas) / n / 1024))
    outputs = {}
    for name, fn in impls.items():
        try:
            outputs[name] = fn(datas[0])  # warm-up, and the output for the parity columns
            times = []
            for data in datas:
                sync(device)
                start = time.perf_counter()
                fn(data)
                sync(device)
                times.append(time.perf_counter() - start)
            row[f"{name}_ms"] = statistics.median(times) * 1e3
        except Exception as exc:
            row[f"{name}_ms"], row[f"{name}_error"] = None, error_text(exc)
    del datas
    ours = outputs.get("ours")
    if ours is None:
        return row, None
    if "hf_pil" in outputs:
        ref = np.asarray(outputs["hf_pil"]["pixel_values"])
        row["hf_pil_exact"] = bool(ref.shape == ours.pixel_values.shape) and bool(
            np.array_equal(ref, ours.pixel_values)
        )
    for name in ("hf_fast_cpu", "hf_fast_cuda"):
        if name in outputs:
            ref = outputs[name]["pixel_values"].float().cpu().numpy()
            same = ref.shape == ours.pixel_values.shape
            row[f"{name}_max_abs_diff"] = (
                float(np.abs(ref - ours.pixel_values).max()) if same else None
            )
    for name, _ in _PREP_IMPLS:
        if row.get(f"{name}_ms") and row.get("ours_ms"):
            row[f"{name}_ratio"] = row[f"{name}_ms"] / row["ours_ms"]
    return row, (ours.pixel_values, ours.grid_thw)


def preprocess_line(row: dict) -> str:
    head = f"RESULT preprocess {row['image']} -> {row['resized']}: "
    if row.get("error"):
        return head + f"FAIL {row['error']}"
    if row.get("ours_ms") is None:
        return head + f"FAIL ours: {row.get('ours_error')}"
    parts = [f"ours {row['ours_ms']:.1f} ms/img"]
    for name, label in _PREP_IMPLS:
        if f"{name}_ms" not in row:
            continue
        if row[f"{name}_ms"] is None:
            parts.append(f"{label} FAIL {row.get(f'{name}_error')}")
            continue
        note = ""
        if "hf_pil_exact" in row and name == "hf_pil":
            note = ", exact" if row["hf_pil_exact"] else ", NOT exact"
        elif row.get(f"{name}_max_abs_diff") is not None:
            note = f", max abs diff {row[f'{name}_max_abs_diff']:.1e}"
        parts.append(
            f"{label} {row[f'{name}_ms']:.1f} ms/img (ratio {row[f'{name}_ratio']:.2f}{note})"
        )
    return head + ", ".join(parts)


def _try_timed(fn, device, warmup, iters):
    """timed(...), or (None, None, 'OOM' | error text) when the call fails."""
    try:
        seconds, out = timed(fn, device, warmup, iters)
        return seconds, out, None
    except Exception as exc:
        error = error_text(exc, 120)
    release(device)
    return None, None, error


@torch.inference_mode()
def vit_one(label, pixel_values, grid, encoder, hf_tower, n, warmup, iters) -> dict:
    """Images/s of one batch of `n` copies of an image, ours and HF's tower, on the same device
    input; rel diff = |ours - HF| / |HF| over the merged embeddings."""
    device, dtype = encoder.device, encoder.dtype
    row = {"image": label, "batch": n, "patches_per_image": int(np.prod(grid))}
    grids = [tuple(int(v) for v in grid)] * n
    try:
        dev = torch.from_numpy(np.concatenate([pixel_values] * n)).to(device, dtype)
        grid_t = torch.tensor(grids, device=device)
    except Exception as exc:
        row.update(ours_error=error_text(exc), hf_error="no input")
        dev = grid_t = None
    if dev is None:
        release(device)
        return row

    def hf_call(dev=dev, grid_t=grid_t):
        if hf_tower is None:
            raise RuntimeError("no HF tower")
        return hf_embeds(hf_tower(dev, grid_thw=grid_t))

    def ours_call(dev=dev):
        return encoder.tower(dev, grids)[0]

    hf_s, hf_out, row["hf_error"] = _try_timed(hf_call, device, warmup, iters)
    ref = None if hf_out is None else hf_out.float()
    del hf_out
    ours_s, out, row["ours_error"] = _try_timed(ours_call, device, warmup, iters)
    rel = None
    if out is not None and ref is not None and out.shape == ref.shape:
        rel = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    del out, ref, dev, grid_t, hf_call, ours_call
    row.update(
        ours_ms=None if ours_s is None else ours_s * 1e3,
        ours_img_s=None if ours_s is None else n / ours_s,
        hf_ms=None if hf_s is None else hf_s * 1e3,
        hf_img_s=None if hf_s is None else n / hf_s,
        ratio=None if not (ours_s and hf_s) else hf_s / ours_s,
        rel_diff=rel,
    )
    release(device)
    return row


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _img_s(row: dict, prefix: str, unit: str = "") -> str:
    if row.get(f"{prefix}_img_s") is not None:
        return f"{row[f'{prefix}_img_s']:.2f}{unit}"
    return "FAIL " + (row.get(f"{prefix}_error") or "n/a")


def vit_line(row: dict) -> str:
    return (
        f"RESULT vit {row['image']} batch {row['batch']} ({row['patches_per_image']} patches/img): "
        f"ours {_img_s(row, 'ours', ' img/s')}, hf {_img_s(row, 'hf', ' img/s')}, ratio "
        f"{_fmt(row.get('ratio'), '.2f')}, rel diff {_fmt(row.get('rel_diff'), '.1e')}"
    )


def print_tables(prep: list, vit: list, unavailable: dict, backend: str) -> None:
    print("\n### Preprocessing, ms per image (median; JPEG decode included)\n")
    print(
        "| image | resized | ours | HF PIL | ratio | exact | HF fast CPU | ratio "
        "| HF fast CUDA | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in prep:
        print(
            f"| {r['image']} | {r['resized']} | {_fmt(r.get('ours_ms'), '.1f')} "
            f"| {_fmt(r.get('hf_pil_ms'), '.1f')} | {_fmt(r.get('hf_pil_ratio'), '.2f')} "
            f"| {r.get('hf_pil_exact', 'n/a')} "
            f"| {_fmt(r.get('hf_fast_cpu_ms'), '.1f')} | {_fmt(r.get('hf_fast_cpu_ratio'), '.2f')} "
            f"| {_fmt(r.get('hf_fast_cuda_ms'), '.1f')} "
            f"| {_fmt(r.get('hf_fast_cuda_ratio'), '.2f')} |"
        )
    print(
        f"\n### Vision tower, images/s (median; same input, same weights; ours on SDPA {backend})\n"
    )
    print("| image | batch | patches/img | ours img/s | HF img/s | ratio | rel diff |")
    print("|---|---|---|---|---|---|---|")
    for r in vit:
        print(
            f"| {r['image']} | {r['batch']} | {r['patches_per_image']} | {_img_s(r, 'ours')} "
            f"| {_img_s(r, 'hf')} | {_fmt(r.get('ratio'), '.2f')} "
            f"| {_fmt(r.get('rel_diff'), '.1e')} |"
        )
    print("\nratio = HF time / ours (> 1: ours faster)")
    for kind, reason in unavailable.items():
        print(f"unavailable: {kind}: {reason}")


def main() -> int:
    if hasattr(sys.stdout, "reconfigure"):  # every stage's line shows as it finishes
        sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny tower and images")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--prep-images", type=int, default=8, help="images per size (3 at max size)")
    ap.add_argument("--batch", type=int, default=8, help="ViT batch (visual_max_batch_size)")
    ap.add_argument("--max-batch", type=int, default=1, help="ViT batch of the max-size image")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip-prep-max", action="store_true", help="no max-size preprocessing row")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.smoke:
        args.device = "cpu"
        args.prep_images, args.batch, args.max_batch = 2, 2, 1
        args.warmup, args.iters = 1, 2
        torch.set_num_threads(1)  # tiny ops: thread wake-ups would dominate on small CPUs
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cpu" and not args.smoke:
        print("FAIL: no CUDA device (use --smoke for the CPU run)")
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    import tempfile

    from visual.encoder import VisionEncoder

    t0 = time.perf_counter()
    torch.manual_seed(0)
    env = environment(device)
    print("env: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(tmp, args.smoke)
        encoder = VisionEncoder.from_pretrained(ckpt, device, dtype, load_weights=False)
    vision = TINY_VISION if args.smoke else QWEN3_5_27B_VISION
    params = sum(p.numel() for p in encoder.tower.parameters())
    backend = attention_backend(encoder)
    print(
        f"tower: {'tiny (smoke)' if args.smoke else 'Qwen3.5-27B'} depth {vision['depth']} "
        f"hidden {vision['hidden_size']}, {params / 1e6:.1f} M params, {dtype} on {device}; "
        f"pixels {encoder.preprocess.min_pixels}..{encoder.preprocess.max_pixels}; "
        f"our attention runs on SDPA backend: {backend}"
    )
    start = time.perf_counter()
    try:
        hf_tower = hf_vision_tower(vision, dict(encoder.tower.named_parameters()), device, dtype)
        print(
            f"HF tower: {type(hf_tower).__name__}, attn {hf_tower.config._attn_implementation}, "
            f"built in {time.perf_counter() - start:.1f} s"
        )
    except Exception as exc:  # keep our numbers even if this transformers lacks the class
        hf_tower = None
        print(f"HF tower unavailable: {type(exc).__name__}: {str(exc)[:200]}")
    release(device)
    sizes = TINY_SIZES if args.smoke else REAL_SIZES
    limits = ImageLimits()
    config = encoder.preprocess
    processors, unavailable = hf_image_processors(config)
    impls = preprocess_impls(processors, limits, config, device)

    prep, inputs = [], {}
    start = time.perf_counter()
    for i, size in enumerate(sizes[:-1] if args.skip_prep_max else sizes):
        row, pixels = preprocess_one(size, impls, config, limits, device, args.prep_images, 10 * i)
        prep.append(row)
        if pixels is not None:
            inputs[size[2]] = pixels
        print(preprocess_line(row))
    print(f"preprocessing benchmark: {time.perf_counter() - start:.1f} s")

    vit = []
    start = time.perf_counter()
    for _width, _height, label in sizes:
        if label not in inputs:
            continue
        n = args.max_batch if label.endswith("(max)") else args.batch
        pixel_values, grid = inputs.pop(label)
        vit.append(
            vit_one(label, pixel_values, grid, encoder, hf_tower, n, args.warmup, args.iters)
        )
        print(vit_line(vit[-1]))
    print(f"ViT benchmark: {time.perf_counter() - start:.1f} s")
    print_tables(prep, vit, unavailable, backend)
    if args.json:
        report = {
            "env": env,
            "vision_config": vision,
            "dtype": str(dtype),
            "attention_backend": backend,
            "args": vars(args),
            "preprocess": prep,
            "vit": vit,
            "unavailable": unavailable,
        }
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
