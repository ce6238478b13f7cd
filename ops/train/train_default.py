"""Trains the embedded default model: generate the instruction set, train a tokenizer, train the
Qwen3.5 VLM (main model + MTP head), write the checkpoint, print held-out accuracy.

    python -m ops.train.train_default --out $OUT/default              # the shipped build (H200)
    python -m ops.train.train_default --out /tmp/d --preset tiny --steps 3   # a CPU smoke run

Reproducible: everything is drawn from --seed (data, tokenizer corpus order, init, batch order).
Writes into --out the checkpoint folder (config, tokenizer, preprocessor config, bf16 safetensors
shards of <= 15 MiB) and eval.json (held-out exact match per family and thinking mode, MTP k=2
accept length). Copy the folder's files into appliance/assets/default/ to ship them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ops.train import chat, checkpoint, data, greedy
from ops.train.model import ModelSize, Qwen3_5Trainable
from ops.train.probe import VisionProbe
from ops.train.sequences import Sequence, collate, encode_many, rendered

PRESETS = {
    "default": ModelSize(),
    "tiny": ModelSize(
        vocab_size=2048,
        hidden_size=64,
        num_layers=4,
        intermediate_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        linear_key_heads=1,
        linear_value_heads=2,
        linear_key_dim=16,
        linear_value_dim=16,
        vit={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "num_position_embeddings": 64,
        },
    ),
}
# Training examples per family (each is used with thinking on and off); held-out per family.
TRAIN_PER_FAMILY = {
    "add": 6000, "sub": 5000, "facts": 3000, "copy": 4000, "reverse": 5000, "count": 5000,
    "followup": 4000, "tool": 4000, "colour": 3000, "shape": 3000, "count_shapes": 4000,
    "position": 3000, "text": 10000,
}  # fmt: skip
# The shipped build's scaling of TRAIN_PER_FAMILY (arithmetic and letter counts need the most data).
DEFAULT_MIX = "add=2,sub=2,followup=1.5,count=2"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=4000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=256, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vision-lr-scale", type=float, default=1.0, help="ViT (and probe) lr x this")
    p.add_argument("--weight-decay", type=float, default=0.1, help="matrices, embeddings excepted")
    p.add_argument("--probe-weight", type=float, default=2.0, help="vision probe loss (0: off)")
    p.add_argument("--mix", default=DEFAULT_MIX, help="family=factor,... scaling TRAIN_PER_FAMILY")
    p.add_argument("--data-scale", type=float, default=1.0, help="x TRAIN_PER_FAMILY")
    p.add_argument("--heldout", type=int, default=40, help="held-out prompts per family and mode")
    p.add_argument("--time-budget", type=float, default=0.0, help="stop training after s (0: off)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shard-mib", type=float, default=15.0, help="largest safetensors file")
    p.add_argument("--eval-batch", type=int, default=128, help="held-out prompts per batch")
    p.add_argument("--max-new", type=int, default=64, help="held-out answer token limit")
    p.add_argument("--log-every", type=int, default=100)
    return p.parse_args(argv)


def _batches(seqs: list[Sequence], batch_size: int, rng: random.Random):
    """Endless batches of similar lengths: shuffle, sort windows of 32 batches, cut, shuffle."""
    while True:
        order = list(range(len(seqs)))
        rng.shuffle(order)
        window = batch_size * 32
        batches = []
        for start in range(0, len(order), window):
            part = sorted(order[start : start + window], key=lambda i: len(seqs[i].ids))
            batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
        rng.shuffle(batches)
        for b in batches:
            yield [seqs[i] for i in b]


def losses(model: Qwen3_5Trainable, batch, loss_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Next-token loss on completion tokens; MTP step 1 (token t+2 from h_t and token t+1) and
    chained step 2 (token t+3 from the step-1 state and token t+2) on completion targets."""
    hidden, _, ctx = model(batch)
    ids = batch.ids
    logits = model.lm_head(hidden[:, :-1]).float()
    main = _masked_ce(logits, ids[:, 1:], loss_mask[:, 1:])
    emb = model.model.language_model.embed_tokens
    tokens = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # row t: token t+1
    y1 = model.mtp_hidden(emb(tokens), hidden, ctx)
    mtp1 = _masked_ce(model.lm_head(y1[:, :-2]).float(), ids[:, 2:], loss_mask[:, 2:])
    tokens2 = torch.cat([ids[:, 2:], ids[:, -2:]], dim=1)  # row t: token t+2
    y2 = model.mtp_hidden(emb(tokens2), y1, ctx)
    mtp2 = _masked_ce(model.lm_head(y2[:, :-3]).float(), ids[:, 3:], loss_mask[:, 3:])
    return main, mtp1, mtp2


def _masked_ce(logits, targets, mask) -> torch.Tensor:
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (ce * mask.flatten()).sum() / mask.sum().clamp(min=1)


def _stop_if_diverged(loss: torch.Tensor, step: int) -> None:
    """Ends the run, before any checkpoint is written, once the loss is NaN or infinite (it never
    recovers, and gpu_build.sh keeps only variants that wrote one)."""
    if not torch.isfinite(loss):
        raise SystemExit(
            f"non-finite loss at step {step}: training diverged, no checkpoint written; try "
            "another --seed or a lower --lr"
        )


def _lr(step: int, total: int, peak: float, elapsed: float = 0.0, budget: float = 0.0) -> float:
    """Linear warm-up, then cosine to 5 % over the steps or the time budget, whichever ends first
    (so a run cut short by --time-budget still ends at a low learning rate)."""
    warm = max(1, min(200, total // 10))
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    if budget:
        frac = max(frac, elapsed / budget)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _param_groups(model: Qwen3_5Trainable, probe: VisionProbe, args) -> list[dict]:
    """Weight decay on matrices (embeddings excepted); the ViT and its probe at lr x
    --vision-lr-scale (1.0 in the shipped build: with the probe on, 0.25-0.5 learned less)."""
    groups: dict[tuple[bool, bool], list] = {}
    named = [*model.named_parameters(), *(("probe." + n, p) for n, p in probe.named_parameters())]
    for name, p in named:
        vision = name.startswith(("model.visual.", "probe."))
        decay = p.dim() >= 2 and "embed" not in name
        groups.setdefault((vision, decay), []).append(p)
    return [
        {
            "params": params,
            "weight_decay": args.weight_decay if decay else 0.0,
            "peak_lr": args.lr * (args.vision_lr_scale if vision else 1.0),
        }
        for (vision, decay), params in groups.items()
    ]


def build_data(args):
    mix = {f: float(x) for f, x in (kv.split("=") for kv in args.mix.split(",") if kv)}
    unknown = set(mix) - set(TRAIN_PER_FAMILY)
    if unknown:
        raise SystemExit(f"--mix: unknown families {sorted(unknown)}")
    scale = {
        f: max(1, round(n * args.data_scale * mix.get(f, 1.0))) for f, n in TRAIN_PER_FAMILY.items()
    }
    train = data.generate("train", args.seed, scale)
    heldout = data.generate("heldout", args.seed, {f: args.heldout for f in data.FAMILIES})
    items = rendered(train)
    # The text family's answers stay out of the BPE corpus: otherwise it merges character pairs
    # ("SSP" -> "SS" "P"), and reading a picture would have to emit pair tokens instead of one
    # token per character (one per image-token column). The shipped build (T3) had that: 25 %.
    texts = [prompt + (e.completion(th) if e.family != "text" else "") for e, th, prompt in items]
    tok = chat.train_tokenizer(texts, PRESETS[args.preset].vocab_size)
    held = encode_many(tok, rendered(heldout), with_completion=False)
    return tok, encode_many(tok, items), held


def train(args) -> dict:
    t0 = time.time()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    size = PRESETS[args.preset]
    tok, train_seqs, heldout_seqs = build_data(args)
    print(
        f"data: {len(train_seqs)} training sequences, {len(heldout_seqs)} held-out prompts, "
        f"vocab {tok.get_vocab_size()}, {time.time() - t0:.1f} s",
        flush=True,
    )
    model = Qwen3_5Trainable(size, seed=args.seed).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters ({2 * params / 2**20:.1f} MiB in bf16)")
    probe = VisionProbe(size.hidden_size, tok.get_vocab_size()).to(device)
    opt = torch.optim.AdamW(
        _param_groups(model, probe, args), betas=(0.9, 0.98), fused=device.type == "cuda"
    )
    pad_id = tok.token_to_id("<|endoftext|>")
    batches = _batches(train_seqs, args.batch_size, random.Random(args.seed))
    model.train()
    t_train = time.time()
    step = 0
    for step in range(args.steps):
        factor = _lr(step, args.steps, 1.0, time.time() - t_train, args.time_budget)
        for group in opt.param_groups:
            group["lr"] = group["peak_lr"] * factor
        seqs = next(batches)
        batch, loss_mask = collate(seqs, device, pad_id)
        with greedy._autocast(device):
            main, mtp1, mtp2 = losses(model, batch, loss_mask)
            loss = main + 0.5 * mtp1 + 0.3 * mtp2
            if args.probe_weight and batch.pixel_values is not None:
                loss = loss + args.probe_weight * probe.loss(model.last_vision, seqs, tok)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            _stop_if_diverged(loss, step)  # at log steps only: no host sync per step
            rate = (step + 1) / (time.time() - t_train)
            print(
                f"step {step}: loss {main.item():.4f} mtp1 {mtp1.item():.4f} "
                f"mtp2 {mtp2.item():.4f} ({rate:.1f} steps/s)",
                flush=True,
            )
        if args.time_budget and time.time() - t_train > args.time_budget:
            print(f"time budget reached after {step + 1} steps", flush=True)
            break
    train_s = time.time() - t_train
    _stop_if_diverged(loss, step)  # the last step may not have been a log step
    model.eval()
    special = chat.special_ids(tok)
    shard_bytes = int(args.shard_mib * 2**20)
    names = checkpoint.save_checkpoint(model.hub_state_dict(), size, special, args.out, shard_bytes)
    chat.save_tokenizer(tok, args.out)
    report = greedy.score(
        model, tok, heldout_seqs, device, batch_size=args.eval_batch, max_new=args.max_new
    )
    report.update(
        steps=step + 1,
        train_seconds=round(train_s, 1),
        total_seconds=round(time.time() - t0, 1),
        parameters=params,
        shards=names,
        seed=args.seed,
        preset=args.preset,
        args={k: str(v) for k, v in vars(args).items() if k not in ("out", "device")},
    )
    (args.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    for key, acc in report["accuracy"].items():
        print(f"held-out {key:24s} {100 * acc:5.1f} %")
    print(
        f"held-out overall {100 * report['overall']:.1f} %, MTP k=2 accept length "
        f"{report['mtp_accept_length_k2']:.2f}, {report['total_seconds']} s in all",
        flush=True,
    )
    return report


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
