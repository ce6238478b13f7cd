"""sample_ref: the documented hash, reproducibility, batch invariance, greedy, and statistical
checks that top-k / top-p / min-p / temperature sample from the right distribution."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.sampling import _mul32, sample_ref, uniform_noise

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
    """The module docstring's spec, in plain Python integers."""
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
