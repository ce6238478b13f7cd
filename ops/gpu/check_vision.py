"""GPU check of the ViT memory reservation (issue "Vision", acceptance point a): with the KV pool
sized around the reservation, a burst of maximum-size images does not run out of memory.

Real-size Qwen3.5-27B vision tower (random bf16 weights) with the default image limits
(appliance.config.VisualConfig). Steps, each printed with its numbers as it finishes:
1. reservation: `appliance.encoder.startup.plan_reservation`, exactly as the visual server calls
   it at startup (measured on CUDA: weights, activation peak, reserved bytes, the worst-case input);
   the SDPA backend our attention runs on is printed with it;
2. pools, sized around the reservation (`--pool`):
   `runner-lite` (default) = the real `ModelRunner` (Qwen3.5-27B text model of ops/bench/configs,
   dummy weights on the device) with `reserved_bytes` = the reservation, its own
   `_slots_from_memory` and `Pools`; only its profile forward (a 2048-token 27B prefill, minutes
   of Triton JIT/autotune on a fresh machine) is skipped and counted as 0 bytes: step 3 stands in;
   `runner` = the same with the profile forward; `formula` = no LLM, the runner's arithmetic
   reproduced with the pools helpers and stand-in tensors (also the fallback if the runner fails);
3. squeeze: a filler tensor takes every free byte but the reservation + `--margin-mib`, standing
   in for the worker's activation peak and the mem_fraction slack (the worst case);
4. burst: batches of `visual_max_batch_size` maximum-size images (square and the steepest
   admissible strip, JPEG bytes) through the server's own encode path (`visual.pipeline.
   encode_jobs`: decode, preprocess, encode, copy out); torch.cuda.max_memory_allocated above
   the start of the burst against the reservation. A failed batch (OOM included) prints its line
   and the burst goes on.
PASS: no OOM, every image encoded, burst peak <= reserved bytes, and the pools left the
reservation free.

  python ops/gpu/check_vision.py [--pool runner] [--json out.json]   # CUDA, ~2 min
  python ops/gpu/check_vision.py --smoke                              # CPU, tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ops.bench.bench_vit import (  # noqa: E402  (exits with one line if pillow/httpx/msgspec lack)
    GIB,
    attention_backend,
    device_name,
    encode_image,
    environment,
    error_text,
    make_photo,
    release,
    write_checkpoint,
)
from visual.preprocess import MAX_ASPECT_RATIO, image_grid, smart_resize  # noqa: E402

MIB = 2**20


def gib(n: float) -> str:
    """Bytes as GiB (MiB below 1 GiB: the --smoke sizes)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.2f} MiB"


# ------------------------------------------------------------------------------ the images


def square_max(config, max_image_pixels: int) -> tuple[int, int]:
    """The largest square image whose resized size is the maximum pixel budget (4096 x 4096 for
    the real preprocessor), within the decoded-pixel limit."""
    side = math.isqrt(config.max_pixels) // config.factor * config.factor
    while side * side > max_image_pixels and side > config.factor:
        side -= config.factor
    return side, side


def steepest_strip(config, max_image_pixels: int, max_side: int = 65500) -> tuple[int, int]:
    """(width, height) of the widest admissible strip (aspect ratio within 99% of the limit,
    long side a JPEG can hold) with the most resized pixels."""
    best, best_key = None, None
    f = config.factor
    h = 1
    while True:
        w_top = min(int(MAX_ASPECT_RATIO * h), max_image_pixels // h, max_side)
        if w_top < 0.99 * MAX_ASPECT_RATIO * h:
            break
        for w in range(max(h, w_top - 2 * f), w_top + 1):
            if w < 0.99 * MAX_ASPECT_RATIO * h:
                continue
            rh, rw = smart_resize(h, w, config)
            key = (rh * rw, w * h)
            if best_key is None or key > best_key:
                best, best_key = (w, h), key
        h += 1
    return best


class _Store:
    """Stands in for the shared-memory segment store: keeps nothing (the burst is about the
    device)."""

    def put(self, name, main, deep=()):
        return name


# ------------------------------------------------------------------------------ the pools


def runner_formula(
    free, activation, reserved, mem_fraction, state, per_slot, seqs, mtp_step, snapshots=0
):
    """ModelRunner._slots_from_memory's arithmetic (appliance/engine/runner.py), term by term;
    `snapshots`: bytes of the prefix-cache snapshot pool the runner chose."""
    budget = (free - activation - reserved) * mem_fraction - state - snapshots
    return int(budget // per_slot) - seqs * mtp_step


@contextlib.contextmanager
def _virtual_device_memory(free: int):
    """--smoke: the CPU runner sizes its pools as a CUDA one does (`_slots_from_memory`), from a
    virtual free-memory figure."""
    from appliance.engine.runner import ModelRunner

    pool_sizes, mem_get_info = ModelRunner._pool_sizes, torch.cuda.mem_get_info

    def sizes_from_memory(self):
        slots, snapshots = self._slots_from_memory()
        return dataclasses.replace(
            pool_sizes(self), num_kv_slots=slots, num_snapshot_slots=snapshots
        )

    ModelRunner._pool_sizes = sizes_from_memory
    torch.cuda.mem_get_info = lambda device=None: (free, free)
    try:
        yield
    finally:
        ModelRunner._pool_sizes, torch.cuda.mem_get_info = pool_sizes, mem_get_info


def pools_with_runner(ckpt: Path, reserved: int, args, device: torch.device, profile: bool) -> dict:
    """Build the real ModelRunner (dummy weights) with reserved_bytes: its `_slots_from_memory`
    sizes the pools and `Pools` allocates them. `profile` False skips the worst-case profile
    forward (activation counted as 0); the free memory it reads is recorded on the way."""
    from appliance.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from appliance.engine.pools import kv_bytes_per_slot, state_bytes_per_slot
    from appliance.engine.runner import ModelRunner

    engine = EngineConfig(
        model=ModelConfig(
            model_dir=str(ckpt), load_format="dummy", max_model_len=args.max_model_len
        ),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
        parallel=ParallelConfig(device=device.type),
        cache=CacheConfig(mem_fraction=args.mem_fraction),
    )
    seen: dict = {}
    original = ModelRunner._profile_activation_bytes

    def activation_bytes(self):
        seen["activation"] = original(self) if profile else 0
        seen["free"] = torch.cuda.mem_get_info(self.device)[0]  # what _slots_from_memory reads
        return seen["activation"]

    virtual = device.type != "cuda"
    free_virtual = 4 * reserved + 64 * MIB  # --smoke: a few reservations' worth
    shim = _virtual_device_memory(free_virtual) if virtual else contextlib.nullcontext()
    start = time.perf_counter()
    ModelRunner._profile_activation_bytes = activation_bytes
    try:
        with shim:
            runner = ModelRunner(engine, reserved_bytes=reserved)
    finally:
        ModelRunner._profile_activation_bytes = original
    if "free" not in seen:
        raise RuntimeError("ModelRunner did not size its pools from memory")
    models = [runner.model, *runner.draft_modules]
    per_slot = max(1, sum(kv_bytes_per_slot(m, runner.kv_dtype) for m in models))
    seqs = engine.scheduler.max_num_seqs
    state = state_bytes_per_slot(runner.model, runner.dtype, runner.mtp_step) * seqs
    expected = runner_formula(
        seen["free"],
        seen["activation"],
        reserved,
        args.mem_fraction,
        state,
        per_slot,
        seqs,
        runner.mtp_step,
        runner.num_snapshot_slots * state_bytes_per_slot(runner.model, runner.dtype),
    )
    how = "real ModelRunner (dummy weights): " + (
        "profile forward, _slots_from_memory, Pools"
        if profile
        else "_slots_from_memory, Pools; profile forward skipped (activation counted 0)"
    )
    return {
        "how": how + ("; CPU: virtual free memory" if virtual else ""),
        "keep": runner,
        "llm_weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
        "free_before_pools": seen["free"],
        "activation": seen["activation"],
        "state_bytes": state,
        "kv_bytes_per_slot": per_slot,
        "kv_slots": runner.num_kv_slots,
        "formula_slots": expected,
        "seconds": time.perf_counter() - start,
    }


def pools_with_formula(ckpt: Path, reserved: int, args, device: torch.device) -> dict:
    """No LLM: the text model is built on the meta device for the pools helpers; on CUDA,
    uint8 tensors stand in for its weights and for the pools; the activation peak is not
    profiled (0). On CPU (--smoke) free memory is a virtual figure."""
    from appliance.engine.pools import kv_bytes_per_slot, state_bytes_per_slot
    from appliance.models.config import load_text_config
    from appliance.models.registry import model_class

    cfg = load_text_config(ckpt)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
    finally:
        torch.set_default_dtype(previous)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_slot = max(1, kv_bytes_per_slot(model, dtype))
    seqs = args.max_num_seqs
    state = state_bytes_per_slot(model, dtype, 0) * seqs
    keep = []
    if device.type == "cuda":
        keep.append(torch.empty(weight_bytes, dtype=torch.uint8, device=device))
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = 4 * reserved + 64 * MIB  # virtual device: a few reservations' worth
    start = time.perf_counter()
    slots = runner_formula(free, 0, reserved, args.mem_fraction, state, per_slot, seqs, 0)
    if slots < 1:
        raise RuntimeError(f"formula gives {slots} KV slots")
    if device.type == "cuda":
        keep.append(torch.empty(state + slots * per_slot, dtype=torch.uint8, device=device))
    return {
        "how": "runner formula reproduced (pools helpers on a meta text model; stand-in tensors)",
        "keep": keep,
        "llm_weight_bytes": weight_bytes,
        "free_before_pools": free,
        "activation": 0,
        "state_bytes": state,
        "kv_bytes_per_slot": per_slot,
        "kv_slots": slots,
        "formula_slots": slots,
        "seconds": time.perf_counter() - start,
    }


# ------------------------------------------------------------------------------ the burst


def run_burst(encoder, batches, limits, device) -> tuple[list, list]:
    """encode_jobs over each batch; per batch the peak above the burst's start. A failed batch
    (OOM included) is printed and recorded, and the next one runs. Returns (rows, failures)."""
    from visual.pipeline import EncodedImage, ImageJob, encode_jobs
    from visual.reservation import MemoryTracker

    store, rows, failures = _Store(), [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        base_reserved = torch.cuda.memory_reserved(device)
    for index, (label, images) in enumerate(batches):
        jobs = [ImageJob(f"burst-{index}-{i}", data, grid) for i, (data, grid) in enumerate(images)]
        patches = sum(t * h * w for _, (t, h, w) in images)
        head = f"burst batch {index + 1}/{len(batches)}: {label}, {patches} patches"
        start = time.perf_counter()
        error = None
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                results = encode_jobs(encoder, store, jobs, limits)
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) - base
                segments = torch.cuda.max_memory_reserved(device) - base_reserved
            else:
                with MemoryTracker() as tracker:
                    results = encode_jobs(encoder, store, jobs, limits)
                peak, segments = tracker.peak, None
        except Exception as exc:
            error = error_text(exc, 300)
        seconds = time.perf_counter() - start
        if error is not None:
            release(device)
            rows.append({"batch": label, "images": len(images), "error": error, "seconds": seconds})
            failures.append(f"batch {index + 1} ({label}): {error}")
            print(f"{head}: FAIL {error}, {seconds:.1f} s")
            continue
        failed = [r for r in results if not isinstance(r, EncodedImage)]
        del results
        rows.append(
            {
                "batch": label,
                "images": len(images),
                "patches": patches,
                "peak_bytes": peak,
                "segment_growth_bytes": segments,
                "not_encoded": len(failed),
                "seconds": seconds,
            }
        )
        seg = "" if segments is None else f", allocator segments +{gib(segments)}"
        print(f"{head}: peak {gib(peak)}{seg}, {seconds:.1f} s")
        if failed:
            failures.append(f"batch {index + 1} ({label}): {len(failed)} not encoded: {failed[0]}")
            print(f"{head}: FAIL {len(failed)} images not encoded: {failed[0]}")
    return rows, failures


def burst_batches(encoder, visual, limits, per_shape: int, mixed: bool) -> tuple[list, dict]:
    config = encoder.preprocess
    batch = visual.visual_max_batch_size
    shapes = {
        "square": square_max(config, visual.max_image_pixels),
        "strip": steepest_strip(config, visual.max_image_pixels),
    }
    made, info = {}, {}
    for seed, (name, (width, height)) in enumerate(shapes.items()):
        data = encode_image(make_photo(width, height, seed=seed + 1), limits.max_bytes)
        grid = image_grid(height, width, config)
        made[name] = (data, grid)
        info[name] = {
            "width": width,
            "height": height,
            "bytes": len(data),
            "grid": grid,
            "patches": grid[0] * grid[1] * grid[2],
        }
        print(
            f"burst image {name}: {width}x{height} ({width * height} px, {len(data) // 1024} KB "
            f"JPEG) -> grid {grid} = {info[name]['patches']} patches"
        )
    batches = []
    for name in ("square", "strip"):
        label = f"{batch} x {name}"
        batches += [(label, [made[name]] * batch) for _ in range(per_shape)]
    if mixed:
        both = [made["square" if i % 2 == 0 else "strip"] for i in range(batch)]
        batches.append((f"{batch} mixed", both))
    return batches, info


# ------------------------------------------------------------------------------ main


def main() -> int:
    if hasattr(sys.stdout, "reconfigure"):  # every stage's line shows as it finishes
        sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny tower (meta-tracked memory)")
    ap.add_argument("--pool", choices=("runner-lite", "runner", "formula"), default="runner-lite")
    ap.add_argument("--batches", type=int, default=1, help="burst batches per shape")
    ap.add_argument("--mixed", action="store_true", help="one more batch, square and strip mixed")
    ap.add_argument("--margin-mib", type=int, default=128, help="free bytes above the reservation")
    ap.add_argument("--max-model-len", type=int, default=0, help="0: the config's")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from appliance.config import VisualConfig
    from appliance.encoder.startup import plan_reservation
    from visual.encoder import VisionEncoder
    from visual.image_io import ImageLimits
    from visual.reservation import worst_case_pixels

    t0 = time.perf_counter()
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        args.mixed = True
        if args.pool == "runner":  # the profile forward needs CUDA
            args.pool = "runner-lite"
        torch.set_num_threads(1)
        visual = VisualConfig(visual_max_batch_size=3, max_image_pixels=200_000)
    elif not torch.cuda.is_available():
        print("FAIL: no CUDA device (use --smoke for the CPU run)")
        return 2
    else:
        device, dtype = torch.device("cuda", 0), torch.bfloat16
        torch.cuda.set_device(device)
        visual = VisualConfig()
    report: dict = {"env": environment(device), "args": vars(args)}
    print("env: " + ", ".join(f"{k} {v}" for k, v in report["env"].items()))
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(tmp, args.smoke)
        torch.manual_seed(0)
        encoder = VisionEncoder.from_pretrained(ckpt, device, dtype, load_weights=False)
        weights = sum(p.numel() * p.element_size() for p in encoder.tower.parameters())
        backend = attention_backend(encoder)
        report["attention_backend"] = backend
        print(
            f"tower: {'tiny (smoke)' if args.smoke else 'Qwen3.5-27B'} on {device_name(device)}, "
            f"{dtype}, {gib(weights)}; our attention runs on SDPA backend: {backend}"
        )

        # 1. reservation, as the visual server takes it
        pixels = worst_case_pixels(encoder.preprocess, visual.max_image_pixels)
        start = time.perf_counter()
        error = None
        try:
            info = plan_reservation(encoder, visual)
        except Exception as exc:
            error = error_text(exc, 300)
        seconds = time.perf_counter() - start
        if error is not None:
            print(
                f"RESULT reservation: FAIL {error} while measuring "
                f"{visual.visual_max_batch_size} x the worst-case image ({pixels} px), "
                f"{seconds:.1f} s"
            )
            if "math" in backend:
                print(
                    "cause: our attention runs on the SDPA math backend, which holds an L x L "
                    "fp32 score matrix per head"
                )
            print("FAIL: the startup reservation itself fails")
            report.update(failures=[f"reservation: {error}"])
            return _finish(report, args, 1, t0)
        t, h, w = info.worst_case_grid
        report["reservation"] = {
            "weights_bytes": weights,
            "worst_case_pixels": pixels,
            "worst_case_grid": [t, h, w],
            "patches_per_image": t * h * w,
            "batch_size": info.batch_size,
            "peak_bytes": info.peak_bytes,
            "reserved_bytes": info.reserved_bytes,
            "seconds": seconds,
        }
        print(
            f"RESULT reservation: worst case {info.batch_size} x {pixels} px -> grid "
            f"{info.worst_case_grid} = {t * h * w} patches/image; measured activation peak "
            f"{gib(info.peak_bytes)}; reserved {gib(info.reserved_bytes)} "
            f"({info.reserved_bytes} B, peak +10% in 64 MiB steps); {seconds:.1f} s"
        )
        reserved = info.reserved_bytes

        # 2. the KV/state pools around the reservation
        pools = None
        if args.pool != "formula":
            error = None
            try:
                pools = pools_with_runner(ckpt, reserved, args, device, args.pool == "runner")
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"[:500]
            if error is not None:  # outside the except block: the failed runner's tensors go
                print(f"pools: ModelRunner failed ({error[:200]}); falling back to --pool formula")
                report["runner_error"] = error
                gc.collect()
                release(device)
        if pools is None:
            pools = pools_with_formula(ckpt, reserved, args, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            free_after = torch.cuda.mem_get_info(device)[0]
        else:
            pool_bytes = pools["state_bytes"] + pools["kv_slots"] * pools["kv_bytes_per_slot"]
            free_after = pools["free_before_pools"] - pool_bytes
        need = pools["activation"] + reserved
        report["pools"] = {k: v for k, v in pools.items() if k != "keep"}
        report["pools"].update(free_after_pools=free_after, mem_fraction=args.mem_fraction)
        kv_total = pools["kv_slots"] * pools["kv_bytes_per_slot"]
        print(
            f"RESULT pools ({pools['how']}): LLM weights {gib(pools['llm_weight_bytes'])}; free "
            f"before pools {gib(pools['free_before_pools'])}; LLM activation "
            f"{gib(pools['activation'])}; ViT reserved {gib(reserved)}; mem_fraction "
            f"{args.mem_fraction} -> state {gib(pools['state_bytes'])} + KV {pools['kv_slots']} "
            f"slots x {pools['kv_bytes_per_slot']} B = {gib(kv_total)} (formula "
            f"{pools['formula_slots']} slots); free after pools {gib(free_after)} (activation + "
            f"reserved = {gib(need)}); {pools['seconds']:.1f} s"
        )
        if free_after < need:
            failures.append(f"pools left {gib(free_after)} < activation + reserved {gib(need)}")
        if pools["formula_slots"] != pools["kv_slots"]:
            failures.append(f"runner slots {pools['kv_slots']} != formula {pools['formula_slots']}")

        # 3. squeeze: only the reservation (+ margin) stays free
        filler = None
        margin = args.margin_mib * MIB
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            if free < reserved + margin:
                failures.append(f"only {gib(free)} free before the burst")
            else:
                filler = torch.empty(free - reserved - margin, dtype=torch.uint8, device=device)
                free = torch.cuda.mem_get_info(device)[0]
            print(
                f"squeeze: filler {gib(0 if filler is None else filler.numel())} (the worker's "
                f"activation peak + mem_fraction slack); free now {gib(free)} = reserved "
                f"{gib(reserved)} + {gib(free - reserved)}"
            )
            report["free_at_burst"] = free
        else:
            print("squeeze: skipped on CPU (memory is tracked, not allocated)")

        # 4. the burst of maximum-size images through the server's encode path
        limits = ImageLimits(visual.max_image_bytes, visual.max_image_pixels)
        start = time.perf_counter()
        batches, images = burst_batches(encoder, visual, limits, args.batches, args.mixed)
        print(f"burst images made in {time.perf_counter() - start:.1f} s")
        report["burst_images"] = images
        start = time.perf_counter()
        rows, burst_failures = run_burst(encoder, batches, limits, device)
        del filler
        report["burst"] = rows
        failures += burst_failures
        done = [r for r in rows if "error" not in r]
        peak = max((r["peak_bytes"] for r in done), default=0)
        n_images = sum(r["images"] - r["not_encoded"] for r in done)
        print(
            f"RESULT burst: {n_images} max-size images encoded in {len(done)}/{len(batches)} "
            f"batches; peak {gib(peak)} = {peak / max(reserved, 1):.1%} of the reservation "
            f"({peak / max(info.peak_bytes, 1):.1%} of the measured worst case); "
            f"{time.perf_counter() - start:.1f} s"
            + (f"; {len(burst_failures)} failed" if burst_failures else "")
        )
        if peak > reserved:
            failures.append(f"burst peak {gib(peak)} > reserved {gib(reserved)}")
    report["failures"] = failures
    if failures:
        print("FAIL: " + "; ".join(failures))
        return _finish(report, args, 1, t0)
    print(
        f"PASS: {n_images} max-size images, peak {gib(peak)} <= reserved {gib(reserved)}, no OOM"
        + (f" with {gib(report['free_at_burst'])} free" if "free_at_burst" in report else "")
    )
    return _finish(report, args, 0, t0)


def _finish(report: dict, args, code: int, t0: float) -> int:
    report["seconds"] = time.perf_counter() - t0
    print(f"total {report['seconds']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json}")
    return code


if __name__ == "__main__":
    sys.exit(main())
