"""sample_ref: the documented hash, reproducibility, batch invariance, greedy, and statistical
checks that top-k / top-p / min-p / temperature sample from the right distribution. sample_triton:
the same uniform bits and the same tokens as sample_ref (interpreted on CPU at small shapes, with a
small candidate capacity so that every search path runs; full size on the GPU)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import DEVICE, generator, gpu
from tolerances import poison

import appliance_kernels.sampling_triton as sampling_triton
from appliance_kernels.sampling import sample
from appliance_kernels.sampling_ref import _mul32, mask_logits_ref, sample_ref, uniform_noise
from appliance_kernels.sampling_triton import (
    argmax_chunks,
    sample_triton,
    topk_candidates,
    uniform_noise_triton,
)

M32 = 0xFFFFFFFF
# chi-square critical values at p = 0.001 by degrees of freedom (fixed seeds: the tests are
# deterministic; a wrong distribution lands far above these)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32, 15: 37.70}


def fmix_py(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def uniform_py(seed: int, offset: int, v: int) -> float:
    """The spec in appliance_kernels/sampling_ref.py's docstring, in plain Python integers."""
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    key = fmix_py((seed >> 32) ^ 0x9E3779B9)
    key = fmix_py(key ^ (seed & M32))
    key = fmix_py(key ^ (offset >> 32))
    key = fmix_py(key ^ (offset & M32))
    bits = fmix_py(key ^ fmix_py((v + 0x632BE5AB) & M32))
    return (bits >> 9) * 2.0**-23 + 2.0**-24


def params(b: int, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=1234):
    return dict(
        temperature=torch.full((b,), temperature),
        top_k=torch.full((b,), top_k, dtype=torch.long),
        top_p=torch.full((b,), top_p),
        min_p=torch.full((b,), min_p),
        seeds=torch.full((b,), seed, dtype=torch.long),
        offsets=torch.arange(b, dtype=torch.long),
    )


def draw(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """n samples of one distribution: n rows, same seed, offsets 0..n-1."""
    return sample_ref(logits_row.expand(n, -1).contiguous(), **params(n, **kw))


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    expected = probs[support].double() * samples.numel()
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def test_mul32_is_exact_mod_2_32() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2**32, (1000,), generator=gen, dtype=torch.long)
    for c in (0x85EBCA6B, 0xC2B2AE35, 0xFFFFFFFF, 1):
        assert _mul32(x, c).tolist() == [(v * c) & M32 for v in x.tolist()]


@pytest.mark.parametrize("seed,offset", [(0, 0), (1234, 7), (-5, 2**40 + 3), (2**63 - 1, 123456)])
def test_noise_matches_documented_hash(seed: int, offset: int) -> None:
    vocab = [0, 1, 2, 1000, 248_319]
    noise = uniform_noise(torch.tensor([seed]), torch.tensor([offset]), 248_320)[0]
    assert [noise[v].item() for v in vocab] == [uniform_py(seed, offset, v) for v in vocab]


def test_noise_is_uniform_and_decorrelated() -> None:
    u = uniform_noise(torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0]), 1 << 16)
    assert 0 < u.min() and u.max() < 1
    bins = torch.bincount((u[0] * 16).long(), minlength=16).double()
    stat = ((bins - 4096) ** 2 / 4096).sum().item()
    assert stat < CHI2_999[15]
    corr = torch.corrcoef(u)
    assert (corr - torch.eye(3)).abs().max() < 0.02  # 1/sqrt(65536) ~ 0.004


def test_fixed_seed_reproduces_and_seed_offset_matter() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    p = params(4)
    first = sample_ref(logits, **p)
    assert torch.equal(first, sample_ref(logits, **p))
    many = [sample_ref(logits, **(p | {"seeds": torch.full((4,), s)})) for s in range(20)]
    assert len({tuple(t.tolist()) for t in many}) > 15
    shifted = [sample_ref(logits, **(p | {"offsets": p["offsets"] + k})) for k in range(20)]
    assert len({tuple(t.tolist()) for t in shifted}) > 15


def test_row_alone_equals_row_in_batch() -> None:
    gen = torch.Generator().manual_seed(2)
    b, v = 16, 500
    logits = torch.randn(b, v, generator=gen) * 3
    batch = dict(
        temperature=torch.rand(b, generator=gen) * 1.5,
        top_k=torch.randint(-1, 50, (b,), generator=gen),
        top_p=torch.rand(b, generator=gen) * 0.9 + 0.1,
        min_p=torch.rand(b, generator=gen) * 0.2,
        seeds=torch.randint(0, 2**62, (b,), generator=gen),
        offsets=torch.randint(0, 10_000, (b,), generator=gen),
    )
    batch["temperature"][0] = 0.0
    together = sample_ref(logits, **batch)
    alone = [
        sample_ref(logits[i : i + 1], **{k: t[i : i + 1] for k, t in batch.items()})
        for i in range(b)
    ]
    assert together.tolist() == torch.cat(alone).tolist()


def test_greedy_and_top_k_1_are_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(3))
    logits[0, 10] = logits[0, 20] = logits[0].max() + 1  # tie: lowest id wins
    greedy = sample_ref(logits, **params(64, temperature=0.0))
    top1 = sample_ref(logits, **params(64, top_k=1, temperature=1.3))
    assert greedy.tolist() == logits.argmax(-1).tolist() == top1.tolist()
    assert greedy[0] == 10 and top1[0] == 10


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
def test_frequencies_match_softmax(temperature: float) -> None:
    samples = draw(LOGITS, 20_000, temperature=temperature)
    stat, dof = chi_square(samples, torch.softmax(LOGITS / temperature, -1))
    assert stat < CHI2_999[dof]


def test_top_k_samples_renormalised_top_k() -> None:
    samples = draw(LOGITS, 20_000, top_k=3)
    probs = torch.softmax(LOGITS, -1)
    probs[3:] = 0
    stat, dof = chi_square(samples, probs / probs.sum())
    assert dof == 2 and stat < CHI2_999[dof]


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.75, 0.9])
def test_top_p_never_leaves_the_nucleus(top_p: float) -> None:
    probs = torch.softmax(LOGITS, -1)  # sorted descending already
    size = int((torch.cumsum(probs, 0) - probs < top_p).sum())  # smallest prefix with mass >= p
    samples = draw(LOGITS, 20_000, top_p=top_p)
    nucleus = probs.clone()
    nucleus[size:] = 0
    stat, dof = chi_square(samples, nucleus / nucleus.sum())
    assert set(samples.unique().tolist()) == set(range(size))
    if dof:
        assert stat < CHI2_999[dof]


def test_top_p_applies_after_top_k() -> None:
    probs = torch.softmax(LOGITS[:4], -1)  # top-4 renormalised: [.41, .25, .15, .09 ...]
    size = int((torch.cumsum(probs, 0) - probs < 0.8).sum())
    samples = draw(LOGITS, 5000, top_k=4, top_p=0.8)
    assert set(samples.unique().tolist()) == set(range(size))


def test_min_p_keeps_tokens_above_fraction_of_max() -> None:
    probs = torch.softmax(LOGITS, -1)
    min_p = 0.3  # keeps p >= 0.3 * p_max: exp(-1.2) ~ 0.30 -> ids 0, 1, 2 (exp(-1) = 0.37)
    keep = probs >= min_p * probs.max()
    assert keep.tolist() == [True, True, True] + [False] * 5
    samples = draw(LOGITS, 20_000, min_p=min_p)
    kept = torch.where(keep, probs, 0.0)
    stat, dof = chi_square(samples, kept / kept.sum())
    assert stat < CHI2_999[dof]


def test_min_p_uses_temperature_scaled_distribution() -> None:
    # at T = 2 the distribution flattens: p_i / p_max = exp((l_i - 2) / 2) >= 0.3 keeps ids 0..4
    samples = draw(LOGITS, 5000, temperature=2.0, min_p=0.3)
    expected = {i for i in range(8) if math.exp((LOGITS[i].item() - 2.0) / 2.0) >= 0.3}
    assert set(samples.unique().tolist()) == expected == {0, 1, 2, 3, 4}


def test_top_p_nucleus_is_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))  # exact binary probabilities
    assert set(draw(logits, 2000, top_p=0.5).unique().tolist()) == {0}  # mass 0.5 reaches 0.5
    assert set(draw(logits, 2000, top_p=0.75).unique().tolist()) == {0, 1}
    assert set(draw(logits, 2000, top_p=0.76).unique().tolist()) == {0, 1, 2}


# --- sample_triton ------------------------------------------------------------------------------


def mixed_batch(b: int, v: int, seed: int, quant: float = 0.0, scale: float = 3.0):
    """Fresh logits and per-row knobs mixing greedy, temperature-only and every filter combination.
    quant > 0 rounds the logits to a 1/quant grid: ties at every top-k / top-p boundary."""
    gen = generator(seed)
    logits = torch.randn(b, v, generator=gen) * scale
    if quant:
        logits = (logits * quant).round() / quant

    def on(prob: float) -> torch.Tensor:
        return torch.rand(b, generator=gen) < prob

    knobs = dict(
        temperature=torch.where(on(0.15), 0.0, torch.rand(b, generator=gen) * 1.5 + 0.2),
        top_k=torch.where(on(0.5), torch.randint(1, v + 5, (b,), generator=gen), -1),
        top_p=torch.where(on(0.5), torch.rand(b, generator=gen), 1.0),
        min_p=torch.where(on(0.3), torch.rand(b, generator=gen) * 0.3, 0.0),
        seeds=torch.randint(-(2**62), 2**62, (b,), generator=gen),
        offsets=torch.randint(0, 2**40, (b,), generator=gen),
    )
    return logits.to(DEVICE), {k: t.to(DEVICE) for k, t in knobs.items()}


def run_triton(logits: torch.Tensor, cap: int = 16, topk_cap: int = 64, **knobs) -> torch.Tensor:
    out = poison(torch.empty(logits.shape[0], dtype=torch.long, device=logits.device))
    got = sample_triton(logits, **knobs, out=out, cap=cap, topk_cap=topk_cap)
    assert got.data_ptr() == out.data_ptr()
    return got


def uniform_knobs(b: int, **kw) -> dict[str, torch.Tensor]:
    return {k: t.to(DEVICE) for k, t in params(b, **kw).items()}


@pytest.mark.parametrize("vocab", [37, 1000])
def test_triton_uniforms_are_the_reference_bits(vocab: int) -> None:
    seeds = torch.tensor([0, 1234, -5, 2**63 - 1], device=DEVICE)
    offsets = torch.tensor([0, 7, 2**40 + 3, 123456], device=DEVICE)
    got = uniform_noise_triton(seeds, offsets, vocab)
    assert torch.equal(got, uniform_noise(seeds, offsets, vocab))


@pytest.mark.parametrize("vocab", [37, 1000])
def test_triton_greedy_and_top_k_1_are_argmax_with_lowest_id_on_ties(vocab: int) -> None:
    logits = torch.randn(5, vocab, generator=generator(vocab)).to(DEVICE)
    logits[0, 3] = logits[0, 20] = logits[0].max() + 1  # tie: lowest id wins
    argmax = logits.argmax(-1).tolist()
    assert run_triton(logits, **uniform_knobs(5, temperature=0.0)).tolist() == argmax
    assert run_triton(logits, **uniform_knobs(5, temperature=1.3, top_k=1)).tolist() == argmax
    assert argmax[0] == 3


@pytest.mark.parametrize("vocab,chunks", [(1000, 8), (1000, 16), (300, 8)])
def test_triton_greedy_over_vocabulary_chunks(vocab: int, chunks: int) -> None:
    """Greedy rows split over vocabulary chunks (a few rows, large vocabulary: an MTP verify):
    ties across and inside chunks go to the lowest id, an all -inf row to 0, chunks past the
    vocabulary (300 ids in 8 chunks of 64) change nothing, sampled rows are unaffected."""
    logits, knobs = mixed_batch(8, vocab, seed=vocab + chunks)
    logits[0, 5] = logits[0, vocab - 3] = logits[0].max() + 1  # tie across chunks
    logits[1, 70] = logits[1, 71] = logits[1].max() + 1  # tie inside a chunk
    logits[2] = float("-inf")
    knobs["temperature"][:3] = 0.0
    want = sample_ref(logits, **knobs).tolist()
    got = sample_triton(logits, **knobs, block=64, chunks=chunks).tolist()
    assert got == want
    assert want[:3] == [5, 70, 0]
    assert (knobs["temperature"][3:] > 0).any()  # sampled rows in the same launch


def test_argmax_chunks_only_for_few_rows_over_a_large_vocabulary() -> None:
    from appliance_kernels.sampling_triton import ARGMAX_MAX_ROWS

    assert argmax_chunks(4, 248320, 1024) > 0
    assert argmax_chunks(ARGMAX_MAX_ROWS + 1, 248320, 1024) == 0
    assert argmax_chunks(4, 1000, 1024) == 0


# (vocab, capacity, quantisation): V <= capacity (all in registers); the value search ending with
# every candidate >= lo in registers or with the boundary interval sorted; quantised logits: ties
# sorted by id in registers, and more tied tokens at a boundary than the capacity (r-th tie by id).
SEARCH_CASES = [(37, 64, 0.0), (37, 8, 0.0), (1000, 16, 0.0), (1000, 16, 2.0), (1000, 32, 8.0)]


@pytest.mark.parametrize("vocab,cap,quant", SEARCH_CASES)
def test_triton_tokens_equal_reference_on_mixed_rows(vocab: int, cap: int, quant: float) -> None:
    # Exact equality: the hash is bit for bit the reference's and the filters keep the same prefix
    # of (value desc, id asc). The interpreter's log (numpy) may differ from torch's in the last
    # ulp, which flips a token only if two kept candidates are within an ulp: not at these seeds.
    logits, knobs = mixed_batch(16, vocab, seed=vocab + cap, quant=quant)
    assert run_triton(logits, cap=cap, **knobs).tolist() == sample_ref(logits, **knobs).tolist()


@pytest.mark.parametrize("knobs", [dict(top_k=40), dict(top_p=0.3), dict(top_k=100, top_p=0.5)])
def test_triton_all_tied_row_keeps_the_lowest_ids(knobs: dict) -> None:
    logits = torch.zeros(3, 500, device=DEVICE)  # 500 ties: the boundary is the r-th tie by id
    p = uniform_knobs(3, **knobs)
    assert run_triton(logits, **p).tolist() == sample_ref(logits, **p).tolist()


def test_triton_masked_vocab_bf16_and_strided_rows() -> None:
    gen = generator(7)
    logits = torch.randn(4, 300, generator=gen) * 2
    logits[:, 200:] = float("-inf")  # padded / masked vocab; top-k 250 keeps all finite ones
    logits[3] = float("-inf")  # nothing finite: token 0, as torch's argmax
    wide = torch.zeros(4, 320, dtype=torch.bfloat16)
    wide[:, :300] = logits.bfloat16()
    view = wide.to(DEVICE)[:, :300]  # bf16 rows with a row stride
    for kw in (dict(top_k=250, top_p=0.95), dict(top_k=30, min_p=0.05), dict(top_p=0.8)):
        p = uniform_knobs(4, **kw)
        expected = sample_ref(view.float(), **p).tolist()
        assert run_triton(view, **p).tolist() == expected
        assert expected[3] == 0


def test_triton_row_alone_equals_row_in_batch() -> None:
    logits, knobs = mixed_batch(6, 500, seed=11)
    together = run_triton(logits, **knobs).tolist()
    alone = [
        run_triton(logits[i : i + 1], **{k: t[i : i + 1] for k, t in knobs.items()}).item()
        for i in range(6)
    ]
    assert together == alone == sample_ref(logits, **knobs).tolist()


def topk_batch(
    b: int, v: int, seed: int, quant: float = 0.0, cap: int = 16
) -> tuple[torch.Tensor, dict]:
    """Rows that take the top-k candidates (0 < top_k <= cap, sampled) with min-p and top-p mixed
    in, a greedy row and a top-p-only row beside them. (A small cap keeps the interpreter fast.)"""
    logits, knobs = mixed_batch(b, v, seed=seed, quant=quant)
    gen = generator(seed + 1)
    knobs["top_k"] = torch.randint(1, cap + 1, (b,), generator=gen).to(DEVICE)
    knobs["temperature"] = (torch.rand(b, generator=gen) * 1.5 + 0.2).to(DEVICE)
    knobs["temperature"][0] = 0.0
    knobs["top_k"][1] = -1
    knobs["top_p"][1] = 0.7
    return logits, knobs


def unpack(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    upper = keys >> 32
    order = upper.to(torch.int32)
    bits = torch.where(order < 0, -order.long() - 2**31, order.long()).to(torch.int32)
    return bits.view(torch.float32), (2**32 - 1) - (keys - (upper << 32))


@pytest.mark.parametrize("vocab,chunk", [(1000, 128), (300, 64), (37, 64), (2500, 2048)])
def test_topk_candidates_are_each_chunks_largest(vocab: int, chunk: int) -> None:
    """Program (row, chunk) keeps the chunk's cap largest scaled logits, value desc then id asc
    (quantised logits: ties inside and across chunks); rows that do not qualify are skipped."""
    cap = 16
    logits, knobs = topk_batch(6, vocab, seed=vocab, quant=2.0, cap=cap)
    knobs["top_k"][2] = cap + 1  # above the cap: not a candidate row
    cand, nch = topk_candidates(logits, knobs["temperature"], knobs["top_k"], cap, chunk)
    chunk = min(chunk, max(cap, 1 << (vocab - 1).bit_length()))
    assert nch == -(-vocab // chunk) and cand.shape[1] >= nch * cap
    for r in (3, 4, 5):
        scaled = logits[r] / knobs["temperature"][r]
        for c in range(nch):
            part = scaled[c * chunk : (c + 1) * chunk].cpu()
            ids = torch.arange(c * chunk, c * chunk + part.numel())
            order = sorted(range(part.numel()), key=lambda i: (-part[i].item(), i))[:cap]
            vals, got_ids = unpack(cand[r, c * cap : c * cap + len(order)].cpu())
            assert got_ids.tolist() == ids[order].tolist(), (r, c)
            assert torch.equal(vals, part[order])


@pytest.mark.parametrize(
    "vocab,chunk,quant",
    [(1000, 128, 0.0), (1000, 64, 2.0), (37, 64, 0.0), (2500, 2048, 4.0)],  # last: 2 x 1024 tiles
)
def test_triton_topk_rows_equal_reference(vocab: int, chunk: int, quant: float) -> None:
    logits, knobs = topk_batch(12, vocab, seed=vocab + chunk, quant=quant)
    want = sample_ref(logits, **knobs).tolist()
    assert sample_triton(logits, **knobs, topk_cap=16, topk_chunk=chunk).tolist() == want
    assert run_triton(logits, **knobs, topk_cap=0).tolist() == want  # the value search


def test_triton_topk_ties_across_chunks_and_rows_without_finite_logits() -> None:
    logits = torch.zeros(4, 500, device=DEVICE)  # all tied: the k lowest ids, across chunks
    logits[1, 450] = 1.0  # the maximum in the last chunk
    logits[2, :] = float("-inf")  # nothing finite: id 0, as the reference
    logits[3, :] = float("-inf")
    logits[3, 7] = logits[3, 300] = 0.5  # fewer finite logits than k
    p = uniform_knobs(4, top_k=12, top_p=0.9)
    want = sample_ref(logits, **p).tolist()
    assert sample_triton(logits, **p, topk_cap=16, topk_chunk=64).tolist() == want
    assert want[2] == 0 and want[3] in (7, 300) and want[0] < 12


def test_triton_topk_rows_read_the_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The top-k rows' tokens come from the candidates (poisoned here: every key (0.0, id 5)),
    the other rows' from the value search."""
    logits, knobs = topk_batch(8, 300, seed=5, cap=64)
    knobs["top_k"][2] = 65  # above the cap
    real = sampling_triton.topk_candidates

    def poisoned(*args, **kw):
        cand, nch = real(*args, **kw)
        return torch.full_like(cand, (2**32 - 1) - 5), nch

    monkeypatch.setattr(sampling_triton, "topk_candidates", poisoned)
    got = sample_triton(logits, **knobs).tolist()
    want = sample_ref(logits, **knobs).tolist()
    fast = [r for r in range(8) if 0 < knobs["top_k"][r] <= 64 and knobs["temperature"][r] > 0]
    assert fast and all(got[r] == 5 for r in fast)
    assert all(got[r] == want[r] for r in range(8) if r not in fast)


def test_dispatcher_matches_reference() -> None:
    logits, knobs = mixed_batch(5, 200, seed=12)
    assert sample(logits, **knobs).tolist() == sample_ref(logits, **knobs).tolist()


@gpu
def test_full_size_greedy_rows_over_vocabulary_chunks() -> None:
    """An MTP verify at batch 1: 4 greedy rows (with one sampled row beside them) of the Qwen3.5
    vocabulary take the chunked argmax; ties planted across chunk boundaries."""
    logits, knobs = mixed_batch(5, 248_320, seed=21, scale=4.0)
    logits[0, 4095] = logits[0, 4096] = logits[0].max() + 1  # the first two chunks' border
    logits[1, 7] = logits[1, 248_300] = logits[1].max() + 1
    knobs["temperature"][:4] = 0.0
    knobs["temperature"][4] = 0.8  # temperature only: the reference's token exactly
    knobs["top_k"][4], knobs["top_p"][4], knobs["min_p"][4] = -1, 1.0, 0.0
    assert argmax_chunks(5, 248_320, 1024) > 0
    got = sample(logits, **knobs)
    assert got[:4].tolist() == logits[:4].argmax(-1).tolist()
    assert got[:2].tolist() == [4095, 7]
    assert got.tolist() == sample_ref(logits, **knobs).tolist()


@gpu
@pytest.mark.parametrize("quant", [0.0, 16.0])
def test_full_size_qwen35_vocab(quant: float) -> None:
    logits, knobs = mixed_batch(64, 248_320, seed=13, quant=quant, scale=4.0)
    knobs["top_k"][:12] = torch.tensor(
        [1, 20, 50, 1000, 5000, 100_000, 248_319, 2048, 20, 64, 65, 40], device=DEVICE
    )
    knobs["temperature"][:12] = 0.7
    knobs["top_p"][8:10] = 0.95
    got = sample(logits, **knobs)
    expected = sample_ref(logits, **knobs)
    # top-p masses are summed in another order (and with the fast exp): a row whose cut lies within
    # float error of p may keep one token more or less. Allow one such row of 64.
    assert (got != expected).sum().item() <= 1
    scaled = logits / torch.where(knobs["temperature"] < 1e-5, 1.0, knobs["temperature"])[:, None]
    kept = mask_logits_ref(scaled, knobs["top_k"], knobs["top_p"], knobs["min_p"]).isfinite()
    assert (~kept.gather(1, got[:, None])).sum().item() <= 1


@gpu
def test_cuda_graph_replay_matches_eager() -> None:
    logits, knobs = mixed_batch(16, 248_320, seed=14)
    knobs["top_k"][:6] = torch.tensor([20, 20, 1, 64, 40, 65], device=DEVICE)  # candidate rows
    knobs["temperature"][:6] = 0.7
    sample_triton(logits, **knobs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample_triton(logits, **knobs)
    for step in range(3):
        knobs["offsets"] += 1  # in place: the buffers the graph reads
        graph.replay()
        assert torch.equal(captured, sample_triton(logits, **knobs)), step


def test_topk_candidates_only_up_to_a_row_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond TOPK_MAX_ROWS rows the value search is faster (docs/benchmarks.md): no candidates."""
    calls = []
    real = sampling_triton.topk_candidates
    monkeypatch.setattr(
        sampling_triton, "topk_candidates", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    monkeypatch.setattr(sampling_triton, "TOPK_MAX_ROWS", 3)
    logits, knobs = topk_batch(4, 100, seed=9)
    want = sample_ref(logits, **knobs).tolist()
    assert run_triton(logits, **knobs).tolist() == want and not calls
    assert run_triton(logits[:3], **{k: t[:3] for k, t in knobs.items()}).tolist() == want[:3]
    assert calls
