"""Adaptive draft control: simulations with synthetic acceptance and step times (no real timing), unit checks,
and the controller driving the real engine (output identical to plain decoding)."""
import json
import logging
import random
import re

import pytest

from flashdraft.config import SamplingParams
from flashdraft.engine.adaptive import AdaptiveConfig, AdaptiveDraft
from flashdraft.engine.generator import FixedDraft

BASE = 15


def cost_model(t0: float, drafter: float, per_token: float):
    """Step time of draft length n: plain t0; drafting adds a fixed drafter pass and a per-guess verify cost."""
    return lambda n: t0 + (drafter + per_token * n if n > 0 else 0.0)


def expected_tokens(n: int, a: float) -> float:
    """Tokens per step when each guess is accepted with probability a once the ones before it were."""
    return 1.0 + sum(a ** k for k in range(1, n + 1))


def true_score(n: int, a: float, cost) -> float:
    return expected_tokens(n, a) / cost(n)


def best_fixed(a: float, cost) -> int:
    return max(range(BASE + 1), key=lambda n: true_score(n, a, cost))


def simulate(policy, steps: int, accept, cost, noise: float = 0.0, seed: int = 0) -> list[int]:
    """Drive the policy for `steps` steps: accept(step) is the acceptance parameter a, cost(step) the cost model;
    step times get seeded multiplicative Gaussian noise. Returns the draft length of every step."""
    rng = random.Random(seed)
    lengths = []
    for s in range(steps):
        n = policy.next_length(BASE)
        a = accept(s)
        accepted = 0
        while accepted < n and rng.random() < a:
            accepted += 1
        policy.record(n, accepted, cost(s)(n) * max(0.3, 1.0 + noise * rng.gauss(0.0, 1.0)))
        lengths.append(n)
    return lengths


def throughput(lengths: list[int], a: float, cost) -> float:
    """Expected tokens per unit time of a run that used these draft lengths."""
    return sum(expected_tokens(n, a) for n in lengths) / sum(cost(n) for n in lengths)


def constant(value):
    return lambda step: value


# (acceptance a, cost model): the best fixed length is short, middle, the full block.
CASES = [
    (0.6, cost_model(10.0, 2.0, 1.0)),
    (0.8, cost_model(10.0, 2.0, 0.5)),
    (0.9, cost_model(10.0, 1.0, 0.3)),
]


@pytest.mark.parametrize("a,cost", CASES)
def test_converges_to_the_best_fixed_length(a, cost):
    best = best_fixed(a, cost)
    assert 0 < best  # drafting pays in these cases
    for seed in range(3):
        policy = AdaptiveDraft(BASE)
        converged_at = None
        for step in range(0, 2000, 25):
            simulate(policy, 25, constant(a), constant(cost), noise=0.05, seed=seed * 1000 + step)
            ratio = true_score(policy.length, a, cost) / true_score(best, a, cost)
            if converged_at is None and ratio >= 0.95:
                converged_at = step + 25
            elif converged_at is not None:
                assert ratio >= 0.9, f"seed {seed}: drifted to length {policy.length} (best {best}) at step {step}"
        assert converged_at is not None and converged_at <= 200, (seed, converged_at, policy.length, best)
        # What the run delivered, exploration and baseline re-measures included.
        lengths = simulate(policy, 1000, constant(a), constant(cost), noise=0.05, seed=seed)
        assert throughput(lengths, a, cost) >= 0.95 * true_score(best, a, cost)


def test_switches_off_when_drafting_loses():
    a, cost = 0.1, cost_model(10.0, 5.0, 0.3)  # low acceptance, expensive drafting: plain decoding is best
    assert best_fixed(a, cost) == 0
    policy = AdaptiveDraft(BASE)
    lengths = simulate(policy, 2000, constant(a), constant(cost), noise=0.1, seed=1)
    assert policy.mode == "off" and policy.length == 0
    first_off = next(i for i, n in enumerate(lengths) if i > 10 and n == 0)
    assert first_off <= 20
    assert sum(n > 0 for n in lengths) <= 0.02 * len(lengths)  # probes only
    assert throughput(lengths, a, cost) >= 0.98 * true_score(0, a, cost)


def test_comes_back_when_drafting_pays_again_and_leaves_when_it_stops():
    cost = cost_model(10.0, 3.0, 0.3)
    prose, code = 0.05, 0.85
    phases = [(0, prose), (800, code), (1600, prose), (2400, code)]

    def accept(step):
        return [a for start, a in phases if step >= start][-1]

    policy = AdaptiveDraft(BASE)
    lengths = simulate(policy, 3200, accept, constant(cost), noise=0.1, seed=2)
    wait_cap = policy.config.probe_interval * 2 ** policy.config.max_backoff
    for start, a in phases[1:]:
        window = lengths[start:start + 600]
        if a == code:
            # Back on within two maximal probe waits (a probe can be unlucky), then near the best fixed speed.
            on = next(i for i in range(len(window)) if all(n > 0 for n in window[i:i + 10]))
            assert on <= 2 * wait_cap + 20, (start, on)
            best = best_fixed(code, cost)
            assert throughput(window[on + 100:], a, cost) >= 0.93 * true_score(best, a, cost)
        else:
            off = next(i for i in range(len(window)) if all(n == 0 for n in window[i:i + 10]))
            assert off <= 100, (start, off)
            assert throughput(window[off:], a, cost) >= 0.97 * true_score(0, a, cost)


@pytest.mark.parametrize("a,cost", CASES)
def test_no_oscillation_under_noise(a, cost):
    policy = AdaptiveDraft(BASE)
    simulate(policy, 500, constant(a), constant(cost), noise=0.2, seed=3)
    settled = policy.switches
    lengths = simulate(policy, 4000, constant(a), constant(cost), noise=0.2, seed=4)
    assert policy.switches - settled <= 30  # fewer than one switch per 130 steps, with 20% timing noise
    assert throughput(lengths, a, cost) >= 0.95 * true_score(best_fixed(a, cost), a, cost)


@pytest.mark.parametrize("a,cost", [(0.25, cost_model(10.0, 1.0, 0.3)),   # drafting gains 13%
                                    (0.12, cost_model(10.0, 0.6, 0.3))])  # 3%, under the profit margin
def test_marginal_drafting_never_loses_and_does_not_flap(a, cost):
    plain = true_score(0, a, cost)
    best = max(true_score(n, a, cost) for n in range(BASE + 1))
    for seed in range(3):
        policy = AdaptiveDraft(BASE)
        lengths = simulate(policy, 4000, constant(a), constant(cost), noise=0.1, seed=seed)
        flips = sum((x == 0) != (y == 0) for x, y in zip(lengths, lengths[1:]))
        assert flips <= 100  # probes included (two flips each): about one per 80 steps at most
        assert throughput(lengths, a, cost) >= max(0.995 * plain, 0.95 * best)


# --- short requests: the controller's own overheads ---------------------------------------------------------------
# bench's default is 128 tokens per prompt, and an engine, a bench run and a server slot keep one controller for
# all their requests. The engine shortens the last steps of a request (max_useful), for any policy alike.

class Pattern:
    """Acceptance as greedy drafting sees it: each step has a run length m of correct guesses (up to the block),
    the same whatever length is drafted, and a step drafting n commits min(n, m) of them. With probability
    `full` the whole block is right (repetitive text); otherwise each guess is right with probability a once
    the ones before it were."""

    def __init__(self, a: float, full: float = 0.0):
        self.a, self.full = a, full

    def draw(self, rng: random.Random, n: int) -> int:
        if rng.random() < self.full:
            return n
        m = 0
        while m < n and rng.random() < self.a:
            m += 1
        return m

    def expected(self, n: int) -> float:
        return self.full * (1 + n) + (1 - self.full) * expected_tokens(n, self.a)


def serve_requests(policy, requests: int, tokens: int, pattern: Pattern, cost, noise=0.05, seed=0,
                   load=lambda step: 1.0) -> list[int]:
    """Run `requests` generations of `tokens` tokens through one policy; load(step) multiplies every step time
    (another process on the machine). Returns the draft length of every step."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(requests):
        produced = 1  # the prefill's token
        while produced < tokens:
            n = policy.next_length(min(tokens - produced - 1, BASE))
            accepted = pattern.draw(rng, n)
            seconds = cost(n) * load(len(lengths)) * max(0.3, 1.0 + noise * rng.gauss(0.0, 1.0))
            policy.record(n, accepted, seconds)
            lengths.append(n)
            produced += accepted + 1
    return lengths


def delivered(lengths: list[int], pattern: Pattern, cost) -> float:
    """Expected tokens per unit time of the steps run (realised acceptance averaged out)."""
    return sum(pattern.expected(n) for n in lengths) / sum(cost(n) for n in lengths)


def best_fixed_delivered(requests: int, tokens: int, pattern: Pattern, cost, seed: int) -> tuple[int, float]:
    """The best fixed length (0 = plain decoding) on the same workload, end-of-request steps included."""
    runs = {n: delivered(serve_requests(FixedDraft(n), requests, tokens, pattern, cost, seed=seed), pattern, cost)
            for n in range(BASE + 1)}
    best = max(runs, key=runs.get)
    return best, runs[best]


CPU_COST = cost_model(10.0, 8.0, 0.1)  # DFlash on a CPU: the drafter pass dominates, nearly flat in the length
GPU_COST = cost_model(10.0, 1.0, 0.3)
HIGH_ACCEPTANCE = [Pattern(0.85), Pattern(0.6, full=0.3)]  # tau about 6.2 and 6.6 at the full block


@pytest.mark.parametrize("pattern", HIGH_ACCEPTANCE, ids=["geometric", "bursty"])
@pytest.mark.parametrize("cost", [CPU_COST, GPU_COST], ids=["cpu", "gpu"])
def test_short_requests_keep_97_percent_of_the_best_fixed_length(pattern, cost):
    """10 requests of 128 tokens through one fresh controller (warm-up, baseline and exploration all paid)."""
    for seed in range(3):
        best, reference = best_fixed_delivered(10, 128, pattern, cost, seed)
        assert best > 0
        lengths = serve_requests(AdaptiveDraft(BASE), 10, 128, pattern, cost, seed=seed)
        assert delivered(lengths, pattern, cost) >= 0.97 * reference, (seed, best)


@pytest.mark.parametrize("a,cost", [(0.1, CPU_COST), (0.3, CPU_COST), (0.1, cost_model(10.0, 5.0, 0.3))])
def test_short_requests_keep_97_percent_of_plain_decoding_when_drafting_loses(a, cost):
    pattern = Pattern(a)
    for seed in range(3):
        best, reference = best_fixed_delivered(10, 128, pattern, cost, seed)
        assert best == 0
        lengths = serve_requests(AdaptiveDraft(BASE), 10, 128, pattern, cost, seed=seed)
        assert delivered(lengths, pattern, cost) >= 0.97 * reference, seed


def test_first_request_starts_at_the_full_block_and_measures_the_baseline_once():
    policy = AdaptiveDraft(BASE)
    lengths = serve_requests(policy, 1, 128, HIGH_ACCEPTANCE[0], CPU_COST)
    assert lengths[:policy.config.warmup] == [BASE] * policy.config.warmup
    plain = sum(n == 0 for n in lengths[:-2])  # the engine may clamp the last steps of a request to 0
    assert plain <= 2  # drafting wins clearly: one plain step, then one more within the request at most
    assert policy.mode == "active" and policy.length == BASE


def test_a_busy_machine_does_not_move_the_length_or_switch_drafting_off():
    """Another process slows every step 3x for 400 steps (longer than any EWMA window), from step 150 on."""
    pattern, cost = HIGH_ACCEPTANCE[0], CPU_COST

    def busy(step):
        return 3.0 if 150 <= step < 550 else 1.0

    for seed in range(3):
        policy = AdaptiveDraft(BASE)
        lengths = serve_requests(policy, 40, 128, pattern, cost, seed=seed, load=busy)
        _, reference = best_fixed_delivered(40, 128, pattern, cost, seed)
        assert delivered(lengths, pattern, cost) >= 0.97 * reference, seed
        assert sum(n == 0 for n in lengths[150:550]) <= 12  # no switching off: end-of-request clamps only
        assert policy.state()["load"] == pytest.approx(1.0)


def test_a_slow_process_start_is_forgotten():
    """A fresh process's first steps are slow (first calls, allocations): 50x for 6 steps, 5x for 4 more. Means
    timed then would price the full block, and plain decoding, far too high for good."""
    pattern, cost = HIGH_ACCEPTANCE[0], CPU_COST

    def slow_start(step):
        return 50.0 if step < 6 else 5.0 if step < 10 else 1.0

    for seed in range(3):
        policy = AdaptiveDraft(BASE)
        lengths = serve_requests(policy, 10, 128, pattern, cost, seed=seed, load=slow_start)
        _, reference = best_fixed_delivered(10, 128, pattern, cost, seed)
        assert delivered(lengths, pattern, cost) >= 0.97 * reference, seed
        assert policy.mode == "active" and policy.length == BASE


def test_one_stalled_step_at_the_start_does_not_mislead_it():
    """A 10x stall on the first warm-up step, or on the first baseline step."""
    pattern, cost = HIGH_ACCEPTANCE[0], CPU_COST
    for stalled in (0, 3):
        policy = AdaptiveDraft(BASE)
        serve_requests(policy, 3, 128, pattern, cost,
                       load=lambda step, stalled=stalled: 10.0 if step == stalled else 1.0)
        assert policy.mode == "active" and policy.length == BASE and policy.switches == 0, stalled


def test_same_inputs_same_decisions():
    runs = []
    for _ in range(2):
        policy = AdaptiveDraft(BASE)
        lengths = simulate(policy, 1500, lambda s: 0.8 if s < 700 else 0.1, constant(cost_model(10, 2, 0.5)),
                           noise=0.2, seed=6)
        runs.append((lengths, policy.state()))
    assert runs[0] == runs[1]


def test_unmeasured_lengths_use_a_linear_cost_fit():
    policy = AdaptiveDraft(BASE)
    line = cost_model(10.0, 2.0, 0.5)
    for _ in range(3):
        policy.record(0, 0, line(0))
    for n in (4, 12):  # every guess accepted, so all positions up to 12 are sampled
        for _ in range(3):
            policy.record(n, n, line(n))
    scores = policy.scores()
    assert set(scores) == set(range(1, BASE + 1))
    assert {n for n, (_, estimated) in scores.items() if not estimated} == {4, 12}
    for n in (1, 8, 11, 15):  # every guess accepted (positions past 12 extrapolated): E(n) = 1 + n
        assert scores[n][0] == pytest.approx((1 + n) / line(n))


def test_one_measured_length_prices_the_others_flat_while_it_wins():
    """One drafting length timed: flat at its time while it beats plain decoding (DFlash drafts the whole block in
    one pass, so the long drafts are the prior); while it loses, the line from the baseline, optimistic for the
    shorter lengths, so that the controller goes and measures one of them."""
    winning, losing = AdaptiveDraft(BASE), AdaptiveDraft(BASE)
    for _ in range(3):
        for policy, accepted in ((winning, BASE), (losing, 0)):
            policy.record(0, 0, 10.0)
            policy.record(BASE, accepted, 25.0)
    assert winning.scores()[5] == pytest.approx(((1 + 5) / 25.0, True))
    # Line (0, 10) -> (15, 25): t(n) = 10 + n; nothing accepted, so E(5) = 1.
    assert losing.scores()[5] == pytest.approx((1 / 15.0, True))


def test_one_log_line_per_switch(caplog):
    policy = AdaptiveDraft(BASE)
    with caplog.at_level(logging.INFO, logger="flashdraft.adaptive"):
        simulate(policy, 1500, lambda s: 0.8 if s < 700 else 0.05, constant(cost_model(10, 3, 0.5)), seed=7)
    lines = [r.getMessage() for r in caplog.records if r.name == "flashdraft.adaptive"]
    assert policy.switches >= 2 and len(lines) == policy.switches
    pattern = re.compile(r"adaptive draft length: \d+ -> \d+ \(score \d+\.\d\d -> \d+\.\d\d tok/s, "
                         r"baseline \d+\.\d\d\)")
    assert all(pattern.fullmatch(line) for line in lines), lines
    assert lines[-1].split(" -> ")[1].startswith("0 ")  # it ended by switching off


def test_state_is_json_and_tracks_the_controller():
    policy = AdaptiveDraft(BASE)
    assert policy.state()["mode"] == "warmup" and policy.state()["baseline_tok_s"] is None
    assert policy.next_length(BASE) == BASE  # a fresh controller starts at the full block
    simulate(policy, 300, constant(0.8), constant(cost_model(0.010, 0.002, 0.0005)), seed=8)
    state = json.loads(json.dumps(policy.state()))
    assert state["mode"] == "active" and state["length"] == policy.length > 0
    assert state["baseline_tok_s"] == pytest.approx(100.0, rel=0.01)  # 1 / 10 ms
    assert state["scores_tok_s"][str(policy.length)] > state["baseline_tok_s"]
    assert state["switches"] == policy.switches and state["steps"] == 300
    assert state["max_length"] == BASE and state["config"]["min_samples"] == 3


def test_respects_the_limit_it_is_given():
    policy = AdaptiveDraft(BASE)
    for limit in [0, 1, 3] * 100:
        n = policy.next_length(limit)
        assert 0 <= n <= limit
        policy.record(n, min(n, 2), 0.01 + 0.001 * n)


def test_without_a_drafter_it_never_drafts():
    policy = AdaptiveDraft(0)
    for _ in range(50):
        assert policy.next_length(10) == 0
        policy.record(0, 0, 0.01)
    assert policy.state()["length"] == 0


def test_bad_input_is_a_clear_error():
    policy = AdaptiveDraft(BASE)
    with pytest.raises(ValueError, match="accepted"):
        policy.record(3, 4, 0.01)
    with pytest.raises(ValueError, match="drafted"):
        policy.record(BASE + 1, 0, 0.01)
    with pytest.raises(ValueError, match="seconds"):
        policy.record(2, 1, float("nan"))
    with pytest.raises(ValueError, match="seconds"):
        policy.record(2, 1, 0.0)
    with pytest.raises(ValueError, match="max_draft"):
        AdaptiveDraft(-1)
    with pytest.raises(ValueError, match="alpha"):
        AdaptiveDraft(BASE, AdaptiveConfig(alpha=0.0))
    with pytest.raises(ValueError, match="off_shortfall"):
        AdaptiveDraft(BASE, AdaptiveConfig(off_shortfall=0))
    with pytest.raises(ValueError, match="min_samples"):
        AdaptiveDraft(BASE, AdaptiveConfig(min_samples=0))


def test_one_stall_does_not_swamp_the_step_time():
    policy = AdaptiveDraft(BASE)
    for _ in range(10):
        policy.record(0, 0, 0.010)
    policy.record(0, 0, 5.0)  # a 500x stall
    assert policy.baseline() > 0.7 * 100.0


# --- on the real engine ---------------------------------------------------------------------------------------------

def test_engine_default_policy(engine):
    assert isinstance(engine.make_policy(), AdaptiveDraft)
    engine.adaptive = False
    try:
        policy = engine.make_policy()
        assert isinstance(policy, FixedDraft) and policy.length == engine.max_draft
        assert isinstance(engine.default_policy(), FixedDraft)
    finally:
        engine.adaptive = True


def test_engine_keeps_its_default_controller_across_requests(engine):
    """Requests that pass no draft share one controller, so only the first pays the warm-up and baseline."""
    policy = engine.default_policy()
    assert isinstance(policy, AdaptiveDraft) and engine.default_policy() is policy
    params = SamplingParams(max_tokens=12, ignore_eos=True, seed=3)
    prompt = engine.encode_prompt("def add(a, b):")
    before = policy.steps
    first = engine.generate(prompt, params)
    second = engine.generate(prompt, params)
    assert engine.default_policy() is policy
    assert policy.steps - before == first.stats.steps + second.stats.steps
    assert first.tokens == second.tokens == engine.generate(prompt, params, draft=0).tokens


def test_engine_output_with_the_controller_is_lossless(engine):
    from flashdraft.engine.oracle import PlantedOracle

    params = SamplingParams(max_tokens=30, ignore_eos=True, seed=11, temperature=0.8)
    prompt = engine.encode_prompt("def add(a, b):")
    plain = engine.generate(prompt, params, draft=0)
    policy = AdaptiveDraft(engine.max_draft)
    oracle = PlantedOracle(prompt + plain.tokens, lambda step: 5, engine.decoder.target.config.vocab_size, "cpu")
    # One slot policy across requests: the target's own continuation planted as guesses (a fresh controller
    # drafts the full block in its warm-up, whatever the timing), then the random drafter, then planted again.
    results = []
    for planted in (True, False, True):
        engine.decoder.oracle = oracle if planted else None
        try:
            results.append(engine.generate(prompt, params, draft=policy))
        finally:
            engine.decoder.oracle = None
        assert results[-1].tokens == plain.tokens
    assert results[0].stats.draft_lengths.get(engine.max_draft, 0) >= policy.config.warmup
    assert results[0].stats.draft_n_accepted > 0
    assert policy.state()["steps"] == sum(r.stats.steps for r in results)  # it saw every step
    assert json.dumps(policy.state())


def test_lengths_handed_out_ahead_are_recorded_in_order():
    """Pipelined steps: the next length is asked for before this step is recorded, and a request's last queued
    step may be dropped unrecorded. Each record goes with the oldest length handed out; unplan forgets the
    newest."""
    policy = AdaptiveDraft(15)
    first, second = policy.next_length(15), policy.next_length(15)
    assert len(policy._planned) == 2
    policy.record(first, 3, 0.01)
    assert len(policy._planned) == 1 and policy._planned[0][1] == second
    policy.next_length(15)
    policy.unplan(1)
    assert len(policy._planned) == 1 and policy._planned[0][1] == second
    policy.record(second, 2, 0.01)
    assert not policy._planned
