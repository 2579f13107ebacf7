"""Warping, position-keyed sampling, and a chi-square test that sampled DFlash output follows the target."""
import math

import pytest
import torch

from flashdraft.config import GREEDY_BELOW, SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.engine.speculative import gumbel_from_bits, gumbel_noise, sample_tokens, warped_candidates


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The warped log-probabilities over the whole vocabulary [T, V] (removed tokens at -inf)."""
    x, ids = warped_candidates(logits, params)
    return x if ids is None else torch.full(logits.shape, float("-inf")).scatter(-1, ids, x)


def reference_warp(logits: list[float], p: SamplingParams) -> list[float]:
    """Plain-Python warping (temperature, top-k, top-p, min-p), written independently of the engine's."""
    def softmax(xs):
        m = max(x for x in xs if x != -math.inf)
        e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
        s = sum(e)
        return [v / s for v in e]

    probs = softmax([x / p.temperature for x in logits])
    if p.top_k:
        kth = sorted(probs, reverse=True)[p.top_k - 1]
        probs = [q if q >= kth else 0.0 for q in probs]
        probs = [q / sum(probs) for q in probs]
    if p.top_p < 1:
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        keep, mass = set(), 0.0
        for i in order:
            if mass >= p.top_p:
                break
            keep.add(i)
            mass += probs[i]
        probs = [q if i in keep else 0.0 for i, q in enumerate(probs)]
        probs = [q / sum(probs) for q in probs]
    if p.min_p:
        top = max(probs)
        probs = [q if q >= p.min_p * top else 0.0 for q in probs]
        probs = [q / sum(probs) for q in probs]
    return probs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
])
def test_warp_matches_reference(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    ours = warp_logits(logits, params).exp()
    for row in range(4):
        ref = torch.tensor(reference_warp(logits[row].tolist(), params))
        assert torch.allclose(ours[row], ref.float(), atol=1e-5)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=64, top_p=0.95),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=5, min_p=0.05),
])
def test_the_tokens_kept_do_not_depend_on_vocabulary_order(params):
    """bf16 logits tie often: top-k keeps the tokens tied with the k-th and top-p those tied with its last kept
    token, so which of two equal values a sort puts first never decides (permuted logits, permuted result)."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(8, 3000, generator=g) * 2).bfloat16().float()
    perm = torch.randperm(3000, generator=g)
    kept, kept_permuted = warp_logits(logits, params), warp_logits(logits[:, perm], params)
    assert torch.equal(kept[:, perm].isfinite(), kept_permuted.isfinite())
    torch.testing.assert_close(kept[:, perm].exp(), kept_permuted.exp())
    tied = torch.tensor([[5.0, 4, 3, 2, 1, 1, 1, 0, -1, -2]])  # the 5th of the top-5 ties with two more
    assert warp_logits(tied, SamplingParams(temperature=1.0, top_k=5)).isfinite().sum() == 7
    # top-p 0.5 reaches its mass within the two 3.0s, whichever sorts first; both are kept
    two_tied = torch.tensor([[3.0, 3.0, 0, 0]])
    assert warp_logits(two_tied, SamplingParams(temperature=1.0, top_p=0.5)).isfinite().sum() == 2


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=64, top_p=0.95),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=5, min_p=0.05),
    SamplingParams(temperature=0.7),
])
def test_sampling_on_the_candidates_is_gumbel_max_over_the_vocabulary(params):
    """sample_tokens draws noise for the warped candidates only; the token is the one Gumbel-max over the whole
    vocabulary picks: argmax of the warped log-probabilities plus every token's noise."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 4000, generator=g) * 3
    positions = torch.arange(40, 56)
    dense = (warp_logits(logits, params) + gumbel_noise(9, positions, 4000)).argmax(-1)
    assert torch.equal(sample_tokens(logits, params, 9, positions), dense)


def test_gumbel_noise_is_keyed_and_well_spread():
    pos = torch.arange(100, 104)
    a, b = gumbel_noise(7, pos, 5000), gumbel_noise(7, pos, 5000)
    assert torch.equal(a, b)
    assert not torch.equal(a, gumbel_noise(8, pos, 5000))
    assert not torch.equal(a[0], a[1])
    # Standard Gumbel: mean = Euler-Mascheroni constant, variance = pi^2 / 6.
    big = gumbel_noise(123, torch.arange(0, 64), 4096)
    assert abs(big.mean().item() - 0.5772) < 0.01
    assert abs(big.var().item() - math.pi ** 2 / 6) < 0.03
    # Same row of noise for one position, whichever block it is computed in.
    assert torch.equal(gumbel_noise(7, torch.tensor([102]), 5000)[0], a[2])


def test_gumbel_noise_is_finite_at_the_top_of_its_range():
    """The largest 24-bit value once rounded to u = 1 in float32 (noise +inf): a token that warping or a grammar
    had removed (-inf) then sampled as NaN, which argmax picked. Seed 2 at position 19 has such a value."""
    bits = torch.tensor([0, 0xFFFFFE00, 0xFFFFFF00, 0xFFFFFFFF])
    noise = gumbel_from_bits(bits)
    assert torch.isfinite(noise).all() and noise[0] < noise[1] < noise[2] == noise[3]
    row = gumbel_noise(2, torch.tensor([19]), 8192)[0]
    assert torch.isfinite(row).all() and row.argmax() == 3475
    only = torch.full((1, 8192), float("-inf"))
    only[0, 5] = 1.0
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3, top_p=0.9)):
        assert sample_tokens(only, params, 2, torch.tensor([19])).item() == 5


def test_greedy_is_argmax():
    logits = torch.randn(3, 20)
    assert torch.equal(sample_tokens(logits, SamplingParams(), 0, torch.arange(3)), logits.argmax(-1))


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: dict, expected: dict, n: int) -> tuple[float, int]:
    """Pearson statistic with cells of expected count < 5 pooled together."""
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        df += 1
    outside = n - sum(counts.get(c, 0) for c in expected)
    pooled_obs += outside
    if pooled_exp > 0 or pooled_obs:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        df += 1
    return stat, df


def test_sampled_dflash_follows_target_distribution(qwen3_dir, drafter_dir):
    """Joint distribution of the first three sampled tokens vs exact probabilities from the target.

    The drafter proposes the target's greedy continuation (so guesses are often accepted and the
    verify-block path is exercised); expected probabilities come from the reference warping above.
    """
    engine = Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=64)
    target = engine.decoder.target
    params = SamplingParams(temperature=1.2, top_k=4, top_p=0.9, min_p=0.05, max_tokens=3, ignore_eos=True)
    prompt = [10, 20, 30]

    @torch.no_grad()
    def next_probs(prefix):
        logits, _ = target(torch.tensor(prefix), torch.arange(len(prefix)), target.new_cache(64), len(prefix))
        return reference_warp(logits[-1].tolist(), params)

    expected = {}
    p1 = next_probs(prompt)
    for a in (i for i, q in enumerate(p1) if q > 0):
        p2 = next_probs(prompt + [a])
        for b in (i for i, q in enumerate(p2) if q > 0):
            p3 = next_probs(prompt + [a, b])
            for c in (i for i, q in enumerate(p3) if q > 0):
                expected[(a, b, c)] = p1[a] * p2[b] * p3[c]

    @torch.no_grad()
    def greedy_oracle(start, guesses):
        prefix = seq.tokens[:start + 1]
        out = []
        for _ in range(guesses.shape[0]):
            logits, _ = target(torch.tensor(prefix + out), torch.arange(len(prefix) + len(out)),
                               target.new_cache(64), len(prefix) + len(out))
            out.append(int(logits[-1].argmax()))
        return torch.tensor(out)

    seq = engine.new_sequence(oracle=greedy_oracle)
    n, counts, accepted = 1500, {}, 0
    for seed in range(n):
        out = engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed}), draft=2, sequence=seq)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        accepted += out.stats.draft_n_accepted
    assert accepted > n // 4  # the verify block really accepted guesses
    stat, df = _chi2(counts, expected, n)
    assert df >= 5
    assert stat < _chi2_critical(df), f"chi2 {stat:.1f} with {df} dof"
    # The test has power: the same samples against the unwarped distribution are rejected.
    unwarped = SamplingParams(temperature=1.2)
    q1 = reference_warp(target(torch.tensor(prompt), torch.arange(3), target.new_cache(64), 3)[0][-1].tolist(),
                        unwarped)
    marginal = {}
    for (a, _, _), c in counts.items():
        marginal[a] = marginal.get(a, 0) + c
    wrong_stat, wrong_df = _chi2(marginal, {i: q for i, q in enumerate(q1)}, n)
    assert wrong_stat > _chi2_critical(wrong_df)


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-20, 9.9e-6])
def test_temperatures_below_the_floor_sample_the_argmax(temperature):
    """Logits of a real model's size: divided by 1e-38 in float32 they overflow, and the softmax is NaN."""
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)) * 30
    params = SamplingParams(temperature=temperature)
    assert params.greedy  # every path decodes it greedily, the graphed greedy step included
    assert torch.equal(sample_tokens(logits, params, 5, torch.arange(8)), logits.argmax(-1))


def test_at_the_floor_sampling_is_finite_and_keyed_by_position():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)) * 30
    params = SamplingParams(temperature=GREEDY_BELOW)
    assert not params.greedy
    assert torch.isfinite(warp_logits(logits, params).max(dim=-1).values).all()
    tokens = sample_tokens(logits, params, 5, torch.arange(8))
    assert torch.equal(tokens, sample_tokens(logits, params, 5, torch.arange(8)))
    assert torch.equal(tokens, logits.argmax(-1))  # gaps of a logit scale of 30 dwarf the noise at 1e-5


def test_tiny_temperature_generates_the_greedy_tokens(engine):
    """Plain and drafted: the floor is in the one sampling function both use, so the output stays lossless."""
    greedy = engine.generate([10, 20, 30], SamplingParams(max_tokens=12, ignore_eos=True), draft=0)
    for draft in (0, 3):
        tiny = engine.generate([10, 20, 30], SamplingParams(temperature=1e-38, max_tokens=12, ignore_eos=True, seed=1),
                               draft=draft)
        assert tiny.tokens == greedy.tokens and tiny.finish_reason == "length"


@pytest.mark.parametrize("columns,with_ids", [(80, True), (80, False), (5000, False), (4500, True)])
def test_the_gumbel_max_kernel_picks_what_the_torch_ops_pick(columns, with_ids):
    """The one-kernel Gumbel-max (the GPU default; Triton's interpreter on a CPU) gives the token of the torch ops
    that define it: candidates with their ids (top-k) or whole rows, one block or many, -inf entries never."""
    pytest.importorskip("triton")
    from triton_interpreter import interpret_without_gpu

    from flashdraft.engine import speculative as sampling
    interpret_without_gpu("flashdraft.kernels.gumbel_triton", sampling._gumbel_kernels)
    g = torch.Generator().manual_seed(columns)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.log_softmax(torch.randn(4, columns, generator=g) * 3, -1)
    x[:, ::3] = float("-inf")  # removed by warping
    ids = torch.randperm(151936, generator=g)[:columns].repeat(4, 1) if with_ids else None
    x, ids = x.to(device), ids.to(device) if with_ids else None
    positions = torch.tensor([0, 7, 19, 5000], device=device)
    for key in (2, sampling.seed_key(11, device)):
        ops = sampling.gumbel_max(x, ids, key, positions, kernel=False)
        assert torch.equal(sampling.gumbel_max(x, ids, key, positions, kernel=True), ops)
        column = ops if ids is None else (ids == ops[:, None]).int().argmax(-1)
        assert torch.isfinite(x.gather(-1, column[:, None])).all()
