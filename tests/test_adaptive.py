"""Adaptive drafting: simulations with synthetic acceptance (the controller reads no timing), the cost model, unit
checks, and the controller driving the real engine (reproducible draft lengths, output identical to plain
decoding)."""
import json
import logging
import random
import re
import types

import pytest
import torch
from torch import nn

from flashdraft.config import SamplingParams
from flashdraft.engine.generator import (AdaptiveConfig, AdaptiveDraft, DraftCost, FixedDraft, batch_length,
                                         estimate_cost,
                                        weight_bytes)

BASE = 15
CPU = DraftCost(fixed=1.19, per_token=0.048)  # the demo pair's estimate on a CPU: the full block costs 2.9 steps
GPU = DraftCost(fixed=0.25, per_token=0.005)  # a large pair on a GPU: 1.33 steps


class Pattern:
    """Acceptance as greedy drafting sees it: each step has a run of m correct guesses, and a step drafting n
    commits min(n, m) of them. With probability `full` the whole block is right (repetitive text); otherwise each
    guess is right with probability a once the ones before it were."""

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
        return self.full * (1 + n) + (1 - self.full) * (1.0 + sum(self.a ** k for k in range(1, n + 1)))


def serve_requests(policy, requests: int, tokens: int, pattern: Pattern, seed: int = 0, timing=None,
                   lengths: list | None = None) -> list[int]:
    """Run `requests` generations of `tokens` tokens through one policy, as the engine does (the last steps of a
    request are offered fewer guesses). timing(rng, n) gives the seconds passed to record (default: noisy).
    Returns the draft length of every step (appended to `lengths` when given)."""
    rng = random.Random(seed)
    clock = random.Random(seed + 1)
    timing = timing or (lambda r, n: 0.01 * (1 + n / 30) * r.uniform(0.5, 3.0))
    lengths = [] if lengths is None else lengths
    for _ in range(requests):
        produced = 1  # the prefill's token
        while produced < tokens:
            n = policy.next_length(min(tokens - produced - 1, BASE))
            accepted = pattern.draw(rng, n)
            policy.record(n, accepted, timing(clock, n))
            lengths.append(n)
            produced += accepted + 1
    return lengths


def delivered(lengths: list[int], pattern: Pattern, cost: DraftCost) -> float:
    """Expected tokens per plain step's time of the steps run (realised acceptance averaged out)."""
    return sum(pattern.expected(n) for n in lengths) / sum(cost.ratio(n) for n in lengths)


def fixed_delivered(n: int, requests: int, tokens: int, pattern: Pattern, cost: DraftCost, seed: int) -> float:
    return delivered(serve_requests(FixedDraft(n), requests, tokens, pattern, seed), pattern, cost)


# --- reproducibility ----------------------------------------------------------------------------------------------

def test_decisions_do_not_depend_on_step_timings():
    """The same acceptance history gives the same draft lengths whatever the step times: steady, noisy, or a
    busy machine with stalls of up to 100x."""
    timings = [lambda r, n: 0.01,
               lambda r, n: 0.01 * (1 + n / 10) * r.uniform(0.8, 1.2),
               lambda r, n: 0.01 * r.choice([1, 1, 1, 3, 10, 100]) * r.uniform(0.2, 5.0)]
    runs = []
    for timing in timings:
        policy = AdaptiveDraft(BASE, cost=CPU)
        lengths = []
        for pattern in (Pattern(0.85), Pattern(0.1), Pattern(0.6, full=0.3), Pattern(0.05), Pattern(0.9)):
            serve_requests(policy, 3, 128, pattern, seed=5, timing=timing, lengths=lengths)
        runs.append((lengths, policy.state()))
    assert runs[0] == runs[1] == runs[2]
    assert 0 in runs[0][0] and BASE in runs[0][0] and runs[0][1]["switches"] >= 2  # it did switch


class Recording:
    """Wraps a policy and keeps every length it handed out."""

    def __init__(self, policy):
        self.policy, self.lengths = policy, []

    def next_length(self, max_useful: int) -> int:
        self.lengths.append(self.policy.next_length(max_useful))
        return self.lengths[-1]

    def record(self, drafted, accepted, seconds):
        self.policy.record(drafted, accepted, seconds)

    def unplan(self, count):
        self.policy.unplan(count)


def test_identical_greedy_generations_repeat_their_draft_lengths_under_random_timings(engine, monkeypatch):
    """Two identical greedy generations, each with a fresh controller, while the engine's clock returns random
    times: the same draft lengths step by step, so the same tau (and the tokens of plain decoding)."""
    from flashdraft.engine import generator
    from flashdraft.bench.oracle import PlantedOracle

    params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompt = engine.encode_prompt("def add(a, b):")
    plain = engine.generate(prompt, params, draft=0)
    # The target's own continuation planted as guesses (the pattern counts drafting steps): long runs, then a
    # stretch where every guess is wrong (drafting switches off), then long runs again (a probe switches it on).
    pattern = lambda step: 0 if 5 <= step < 28 else 99  # noqa: E731
    oracle = PlantedOracle(prompt + plain.tokens, pattern, engine.decoder.target.config.vocab_size, "cpu")
    cost = DraftCost(fixed=0.5, per_token=0.02)
    config = AdaptiveConfig(probe_interval=4)
    clock = random.Random(0)
    monkeypatch.setattr(generator, "time", types.SimpleNamespace(perf_counter=lambda: clock.uniform(0, 1e3)))
    runs = []
    for _ in range(2):
        oracle.reset()
        policy = Recording(AdaptiveDraft(engine.max_draft, config, cost))
        result = engine.generate(prompt, params, draft=policy, sequence=engine.new_sequence(oracle=oracle))
        assert result.tokens == plain.tokens
        runs.append((policy.lengths, result.stats.tau, result.stats.draft_lengths))
    assert runs[0] == runs[1]
    lengths = runs[0][0]
    assert 0 in lengths and engine.max_draft in lengths and policy.policy.switches >= 2


# --- switching drafting off and on --------------------------------------------------------------------------------

def test_low_acceptance_switches_drafting_off_and_probes_with_backoff():
    """The linked-list case: 10% acceptance, where the full block (2.9 plain steps on the CPU) commits about 1.1
    tokens. Drafting stops within a few steps; probes come after 4, 8, 16, 32, 64, then every 128 plain steps,
    and mostly cost one step each."""
    policy = AdaptiveDraft(BASE, cost=CPU)
    lengths = serve_requests(policy, 1, 3000, Pattern(0.1), seed=1)
    assert policy.mode == "off" and policy.length == 0
    first_off = lengths.index(0)
    assert first_off <= 6
    starts = [i for i in range(first_off, len(lengths)) if lengths[i] > 0 and lengths[i - 1] == 0]
    gaps = [b - a for a, b in zip([first_off] + starts, starts)]
    # Each probe mostly one step (a few steps when one of its guesses is accepted), then the plain wait.
    for gap, wait in zip(gaps, [4, 8, 16, 32, 64, 128, 128, 128]):
        assert wait <= gap <= wait + 3, gaps
    assert sum(n > 0 for n in lengths) <= 0.02 * len(lengths)
    assert delivered(lengths, Pattern(0.1), CPU) >= 0.97


@pytest.mark.parametrize("a", [0.1, 0.3, 0.45])
def test_short_requests_where_drafting_loses_stay_near_plain_speed(a):
    """A fresh controller (as `flashdraft generate` makes), one request of 128 tokens, full block losing on the
    CPU: the start and the probes cost at most 15% against plain decoding (the full block loses 37-62%)."""
    pattern = Pattern(a)
    assert pattern.expected(BASE) < CPU.ratio(BASE)
    for seed in range(5):
        lengths = serve_requests(AdaptiveDraft(BASE, cost=CPU), 1, 128, pattern, seed=seed)
        assert delivered(lengths, pattern, CPU) >= 0.85, seed


def test_a_controller_shared_across_prompts_stops_drafting_on_a_prompt_that_loses():
    """As in `flashdraft bench`: prompts where drafting wins, then one where it does not (9.6% acceptance). The
    losing prompt still runs at >= 85% of plain speed on its first request and >= 95% on the next ones (the full
    block: 38%)."""
    code, linked = Pattern(0.85), Pattern(0.096)
    for seed in range(5):
        policy = AdaptiveDraft(BASE, cost=CPU)
        serve_requests(policy, 6, 256, code, seed=seed)
        first = serve_requests(policy, 1, 256, linked, seed=seed)
        later = serve_requests(policy, 2, 256, linked, seed=seed + 100)
        assert delivered(first, linked, CPU) >= 0.85, seed
        assert delivered(later, linked, CPU) >= 0.95, seed
    assert fixed_delivered(BASE, 1, 256, linked, CPU, 0) < 0.4


@pytest.mark.parametrize("pattern,cost", [(Pattern(0.85), CPU), (Pattern(0.6, full=0.3), CPU),
                                          (Pattern(0.85), GPU), (Pattern(0.5), GPU)],
                         ids=["cpu-geometric", "cpu-bursty", "gpu-geometric", "gpu-low"])
def test_drafting_that_pays_stays_on_at_the_full_block(pattern, cost):
    """Where drafting wins, 10 requests of 128 tokens deliver >= 98% of the full block's throughput: no plain
    steps but the ones that end a request."""
    for seed in range(3):
        policy = AdaptiveDraft(BASE, cost=cost)
        lengths = serve_requests(policy, 10, 128, pattern, seed=seed)
        reference = fixed_delivered(BASE, 10, 128, pattern, cost, seed)
        assert reference > 1.0
        assert delivered(lengths, pattern, cost) >= 0.98 * reference, seed
        assert policy.mode == "on" and policy.switches <= 2  # off and back on at most (an unlucky start)
        assert lengths[:3] == [BASE] * 3


def test_comes_back_when_drafting_pays_again_and_leaves_when_it_stops():
    prose, code = Pattern(0.05), Pattern(0.85)
    policy = AdaptiveDraft(BASE, cost=CPU)
    wait_cap = policy.config.probe_interval * 2 ** policy.config.max_backoff
    for phase in range(4):
        pattern = prose if phase % 2 == 0 else code
        lengths = serve_requests(policy, 1, 1200, pattern, seed=phase)
        if pattern is code:
            # Back on within two maximal probe waits (a probe's first step may accept nothing: 15% here).
            on = next(i for i in range(len(lengths)) if all(n > 0 for n in lengths[i:i + 10]))
            assert on <= 2 * wait_cap + 5, (phase, on)
            assert delivered(lengths[on:], code, CPU) >= 0.98 * code.expected(BASE) / CPU.ratio(BASE)
        else:
            off = next(i for i in range(len(lengths)) if all(n == 0 for n in lengths[i:i + 4]))
            assert off <= 25, (phase, off)
            assert delivered(lengths[off:], prose, CPU) >= 0.97


@pytest.mark.parametrize("a", [0.6, 0.65])
def test_marginal_drafting_does_not_flap(a):
    """Where drafting wins or loses by a few percent, the controller switches rarely (probes included: one on/off
    flip per 12 steps at most) and delivers at least 95% of the better of plain decoding and the full block."""
    pattern = Pattern(a)
    best = max(1.0, pattern.expected(BASE) / CPU.ratio(BASE))
    for seed in range(3):
        policy = AdaptiveDraft(BASE, cost=CPU)
        lengths = serve_requests(policy, 1, 6000, pattern, seed=seed)
        flips = sum((x == 0) != (y == 0) for x, y in zip(lengths, lengths[1:]))
        assert flips <= 0.08 * len(lengths), seed
        assert delivered(lengths, pattern, CPU) >= 0.95 * best, seed


def test_a_request_end_is_decoded_plainly_where_a_short_draft_does_not_pay():
    """The drafter pass costs the same for 2 guesses as for 15: near the end of a request (or under a request's
    n_max) a short draft is skipped where it would lose, and kept where it pays."""
    for cost, expected in ((CPU, 0), (GPU, 1)):
        policy = AdaptiveDraft(BASE, cost=cost)
        serve_requests(policy, 1, 64, Pattern(0.85), seed=0)
        assert policy.mode == "on"
        assert policy.next_length(1) == expected  # E(1) = 1.85 tokens: 2.24 plain steps on the CPU, 1.26 on a GPU
        assert policy.next_length(40) == BASE


# --- the cost model ------------------------------------------------------------------------------------------------

def test_cost_model_is_fixed_at_creation_and_priced_per_device(engine):
    d = engine.decoder
    cpu, gpu = estimate_cost(d.target, d.drafter, "cpu"), estimate_cost(d.target, d.drafter, "cuda")
    assert cpu == estimate_cost(d.target, d.drafter, "cpu")  # no timing: the same every time
    for cost in (cpu, gpu):
        assert 1.0 < cost.ratio(1) < cost.ratio(engine.max_draft)
    assert cpu.ratio(engine.max_draft) > gpu.ratio(engine.max_draft)  # a CPU's multi-row products cost more
    policy = AdaptiveDraft.for_engine(engine)
    assert policy.cost == cpu and policy.base == engine.max_draft
    assert policy.state()["step_cost"] == pytest.approx(cpu.ratio(engine.max_draft))


def test_a_batched_steps_cost_grows_with_its_streams(engine):
    """estimate_cost for S streams stepping together: on a CPU a batched step of S drafting streams against one of
    S plain streams costs more plain steps the more streams share it (a CPU's one-row pass is cheaper than any
    multi-row one, so two streams' ratio is below one's); on a GPU the verify rows stay nearly free while a pass
    is memory-bound (up to 16 rows), then each costs its arithmetic (the H200's batched steps), so the ratio grows
    with the streams past that. One stream's is the single stream's; the engine makes each count's once and the
    policy it makes prices with them."""
    d = engine.decoder
    cpu = [estimate_cost(d.target, d.drafter, "cpu", s).ratio(engine.max_draft) for s in (1, 2, 4, 16)]
    assert cpu[1] < cpu[2] < cpu[3] and cpu[0] < cpu[3]
    gpu = [estimate_cost(d.target, d.drafter, "cuda", s).ratio(engine.max_draft) for s in (1, 2, 4, 16)]
    # within 16 rows (2 streams of this pair's 8-row blocks) nearly flat; past them each row is arithmetic
    assert engine.max_draft + 1 == 8 and gpu[0] < gpu[1] < 1.05 * gpu[0] and gpu[1] < gpu[2] < gpu[3]
    # each length priced exactly, where the line through n = 1 and the block does not bend: at 4 streams the 3
    # guesses' 16 verify rows cost no more per row than 4 streams' one guess (below the line), past them more
    four = estimate_cost(d.target, d.drafter, "cuda", 4)
    line = [1 + four.fixed + four.per_token * n for n in range(8)]
    assert len(four.ratios) == 8 and four.ratios[0] == 1.0
    assert four.ratios[1] == pytest.approx(line[1]) and four.ratios[7] == pytest.approx(line[7])
    assert four.ratios[3] < line[3] - 0.01 and four.ratio(3) == four.ratios[3]
    assert all(a < b for a, b in zip(four.ratios[1:], four.ratios[2:]))
    with pytest.raises(ValueError, match="ratios must be numbers >= 1"):
        DraftCost(ratios=(1.0, 0.5))
    for device in ("cpu", "cuda"):
        assert estimate_cost(d.target, d.drafter, device, 1) == estimate_cost(d.target, d.drafter, device)
    assert engine.draft_cost(4) is engine.draft_cost(4) and engine.draft_cost(1) == policy_cost(engine)
    policy = AdaptiveDraft.for_engine(engine)
    policy.set_streams(4)
    assert policy.step_cost() == engine.draft_cost(4) and policy.state()["streams"] == 4
    assert policy.state()["step_cost"] == pytest.approx(engine.draft_cost(4).ratio(engine.max_draft))
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValueError, match="streams must be an integer >= 1"):
            policy.set_streams(bad)


def policy_cost(engine) -> DraftCost:
    return AdaptiveDraft.for_engine(engine).cost


class Steady(Pattern):
    """Every step's first m guesses right: E(n) = min(m, n) + 1, no noise."""

    def __init__(self, m: int):
        self.m = m

    def draw(self, rng: random.Random, n: int) -> int:
        return min(self.m, n)

    def expected(self, n: int) -> float:
        return min(self.m, n) + 1.0


def test_drafting_switches_off_where_the_batch_makes_it_lose_and_back_on_alone():
    """Three tokens a drafting step pay alone (gain 1.5 at 2 plain steps a drafting step) but not in a batch of 8
    streams (4.5 plain steps): drafting goes off once 8 streams step together, and a probe brings it back once the
    slot steps alone again; a policy without a batch cost keeps drafting."""
    costs = {1: DraftCost(fixed=0.7, per_token=0.02), 8: DraftCost(fixed=3.0, per_token=0.034)}
    pattern = Steady(2)
    batched, single = AdaptiveDraft(BASE, cost=costs[1], batch_cost=costs.__getitem__), AdaptiveDraft(BASE, cost=costs[1])
    for policy in (batched, single):
        serve_requests(policy, 2, 64, pattern)
        assert policy.mode == "on" and policy.gain() == pytest.approx(1.5)
        policy.set_streams(8)
    assert batched.step_cost() == costs[8] and single.step_cost() == costs[1]
    off = serve_requests(batched, 2, 64, pattern)
    serve_requests(single, 2, 64, pattern)
    assert batched.mode == "off" and batched.gain() == pytest.approx(3 / 4.51) and single.mode == "on"
    # A clear loss: drafting the batch's best length (3: gain 3 / 4.10), about a quarter of a plain step short a
    # step, goes off after four steps.
    assert off[:5] == [3, 3, 3, 3, 0]
    assert off.count(0) > 2 * off.count(BASE)  # then plain, but for probes
    batched.set_streams(1)
    lengths = serve_requests(batched, 4, 64, pattern)
    assert batched.mode == "on" and batched.switches == 2 and all(n > 0 for n in lengths[-10:])


def test_streams_stepping_together_draft_the_length_that_pays_best():
    """With several streams in a batched step every verify row costs (per_token large): the policy drafts the
    candidate length (2^k - 1 or the block) of the best gain, here 7 for runs of 5 right guesses (E = 6 from n = 5
    on), and the full block again after a step whose 7 guesses were all right; alone it drafts the full block."""
    costs = {1: DraftCost(fixed=0.3, per_token=0.004), 4: DraftCost(fixed=0.4, per_token=0.1)}
    policy = AdaptiveDraft(BASE, cost=costs[1], batch_cost=costs.__getitem__)
    alone = serve_requests(policy, 1, 64, Steady(5))
    assert alone[:8] == [BASE] * 8  # (the request's last steps are offered fewer)
    policy.set_streams(4)
    assert policy.gain(7) == pytest.approx(6 / 2.1) and policy.gain(7) > policy.gain(BASE)
    assert policy.length == 7 and policy.state()["length"] == 7
    batched = serve_requests(policy, 1, 64, Steady(5))
    assert batched[:8] == [7] * 8 and policy.mode == "on" and policy.length == 7
    # every guess right at 7: the next step drafts the block, which teaches E(n) past 7 (11 a step from n = 10 on)
    lengths = serve_requests(policy, 1, 200, Steady(10))
    assert lengths[:2] == [7, BASE]
    assert policy.expected_tokens(BASE) > 10.0 and policy.length == BASE  # ~11 / 2.9 beats 8 / 2.1
    policy.set_streams(1)
    assert policy.length == BASE


def test_a_batch_drafts_one_length_the_one_its_streams_gain_most_from_together():
    """Streams stepping together draft one length (batch_length; few compositions of a batched step, few graphs):
    the candidate of the largest summed gain E_i(n) / R(n), the full block after any stream's step had every guess
    right at a shorter length, none before any stream drafts on its estimates; set_streams hands it to each policy,
    whose own choice it replaces."""
    costs = {1: DraftCost(fixed=0.3, per_token=0.004), 4: DraftCost(fixed=0.4, per_token=0.1)}  # R(n) = 1.4 + 0.1 n

    def learnt(run: int) -> AdaptiveDraft:
        policy = AdaptiveDraft(BASE, cost=costs[1], batch_cost=costs.__getitem__)
        serve_requests(policy, 1, 64, Steady(run))
        policy.set_streams(4)
        return policy

    assert batch_length([AdaptiveDraft(BASE, cost=costs[1], batch_cost=costs.__getitem__)]) is None
    five, five_too, one, one_too, one_more = learnt(5), learnt(5), learnt(1), learnt(1), learnt(1)
    assert (five.length, one.length) == (7, 1)  # alone in the batch's cost, each its own best
    # two runs of 5 and one of 1: summed gains 4.0 / 5.88 / 6.67 / 4.83 at 1 / 3 / 7 / 15
    assert batch_length([five, five_too, one]) == 7
    # one run of 5 and three of 1: 5.33 / 5.88 / 5.71 / 4.14
    assert batch_length([five, one, one_too, one_more]) == 3
    for policy in (five, one):
        policy.set_streams(4, 3)
        assert policy.length == 3 and policy.state()["length"] == 3
    off = learnt(0)
    off.mode = "off"
    assert batch_length([off]) is None and batch_length([off, five]) == 7
    five.all_right = True  # its last step at a shorter length had every guess right
    assert batch_length([five, one]) == BASE
    with pytest.raises(ValueError, match="one of"):
        five.set_streams(4, 5)
    five.set_streams(1, None)
    assert five.length == BASE


def test_weight_bytes_counts_each_matrix_once():
    """Fused projections are views of one storage, a tied LM head is the embedding table, and an untied
    embedding table is not read by a pass (one row is looked up)."""

    class Tiny(nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed = nn.Embedding(100, 8)
            self.q, self.k = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
            fused = torch.cat([self.q.weight, self.k.weight]).detach()
            self.q.weight, self.k.weight = nn.Parameter(fused[:8]), nn.Parameter(fused[8:])
            self.norm = nn.LayerNorm(8)
            self.lm_head = nn.Linear(8, 100, bias=False)
            if tied:
                self.lm_head.weight = self.embed.weight

    for tied in (True, False):
        lm, experts, other = weight_bytes(Tiny(tied))
        assert (lm, experts, other) == (100 * 8 * 4, 0, 16 * 8 * 4)


def test_a_mixture_of_experts_prices_the_experts_a_verify_pass_reads():
    """A plain step reads top_k of the experts; a verify pass of n + 1 rows up to (n + 1) * top_k of them."""

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(16, 8, 8))

    def model(moe: bool):
        m = nn.Module()
        m.body = nn.Linear(8, 8, bias=False)
        m.lm_head = nn.Linear(8, 8, bias=False)
        if moe:
            m.experts = Experts()
        m.config = types.SimpleNamespace(num_experts=16 if moe else 0, top_k_experts=2)
        return m

    drafter = nn.Module()
    drafter.layer = nn.Linear(8, 8, bias=False)
    drafter.block_size = 16
    dense, moe = estimate_cost(model(False), drafter, "cuda"), estimate_cost(model(True), drafter, "cuda")
    assert moe.ratio(7) > 1.5 * dense.ratio(7)


def test_draft_cost_ratio_and_validation():
    cost = DraftCost(fixed=1.0, per_token=0.1)
    assert cost.ratio(0) == 1.0 and cost.ratio(5) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="fixed"):
        DraftCost(fixed=-1.0)
    with pytest.raises(ValueError, match="per_token"):
        DraftCost(per_token=float("nan"))


# --- unit checks --------------------------------------------------------------------------------------------------

def test_expected_tokens_from_per_position_acceptance():
    policy = AdaptiveDraft(BASE)
    for _ in range(40):
        policy.record(BASE, BASE, 0.01)  # every guess accepted: E(n) = 1 + n
    assert policy.expected_tokens(4) == pytest.approx(5.0)
    assert policy.expected_tokens(BASE) == pytest.approx(16.0)
    for _ in range(200):
        policy.record(BASE, 0, 0.01)  # then every first guess wrong: E falls at every depth at once
    assert policy.expected_tokens(BASE) < 1.01


def test_one_log_line_per_switch(caplog):
    policy = AdaptiveDraft(BASE, cost=CPU)
    with caplog.at_level(logging.INFO, logger="flashdraft.adaptive"):
        for pattern in (Pattern(0.9), Pattern(0.05), Pattern(0.9), Pattern(0.05)):
            serve_requests(policy, 1, 800, pattern, seed=7)
    lines = [r.getMessage() for r in caplog.records if r.name == "flashdraft.adaptive"]
    assert policy.switches >= 3 and len(lines) == policy.switches
    line = re.compile(r"adaptive drafting (on|off) \(expected \d+\.\d\d tokens per step at length 15, "
                      r"step cost \d+\.\d\d plain steps: gain \d+\.\d\d; 1 stream\(s\)\)")
    assert all(line.fullmatch(text) for text in lines), lines
    assert lines[-1].startswith("adaptive drafting off")


def test_state_is_json_and_tracks_the_controller():
    policy = AdaptiveDraft(BASE, cost=CPU)
    state = policy.state()
    assert state["mode"] == "on" and state["gain"] is None and state["length"] == BASE
    assert policy.next_length(BASE) == BASE  # a fresh controller starts at the full block
    policy.unplan(1)
    serve_requests(policy, 2, 128, Pattern(0.85), seed=8)
    state = json.loads(json.dumps(policy.state()))
    assert state["mode"] == "on" and state["length"] == BASE and state["max_length"] == BASE
    assert state["gain"] == pytest.approx(state["expected_tokens"] / state["step_cost"])
    assert state["gain"] > 1 and state["step_cost"] == pytest.approx(CPU.ratio(BASE))
    assert state["cost"] == {"fixed": 1.19, "per_token": 0.048, "ratios": []}
    assert state["steps"] == policy.steps and state["config"]["min_samples"] == 3
    serve_requests(policy, 2, 128, Pattern(0.02), seed=9)
    state = policy.state()
    assert state["mode"] == "off" and state["length"] == 0 and state["gain"] < 1


def test_respects_the_limit_it_is_given():
    policy = AdaptiveDraft(BASE)
    for limit in [0, 1, 3, 20] * 100:
        n = policy.next_length(limit)
        assert 0 <= n <= min(limit, BASE)
        policy.record(n, min(n, 2), 0.01)


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
    with pytest.raises(ValueError, match="max_draft"):
        AdaptiveDraft(-1)
    with pytest.raises(ValueError, match="alpha"):
        AdaptiveDraft(BASE, AdaptiveConfig(alpha=0.0))
    with pytest.raises(ValueError, match="off_shortfall"):
        AdaptiveDraft(BASE, AdaptiveConfig(off_shortfall=0))
    with pytest.raises(ValueError, match="min_samples"):
        AdaptiveDraft(BASE, AdaptiveConfig(min_samples=0))


def test_lengths_handed_out_ahead_are_recorded_in_order():
    """Pipelined steps: the next length is asked for before this step is recorded, and a request's last queued
    step may be dropped unrecorded. Each record goes with the oldest length handed out; unplan forgets the
    newest."""
    policy = AdaptiveDraft(BASE, cost=CPU)
    for _ in range(3):
        policy.record(policy.next_length(BASE), 0, 0.01)
    # Two steps handed out; the first one's record switches drafting off; the second was planned while on.
    first, second = policy.next_length(BASE), policy.next_length(BASE)
    assert (first, second) == (BASE, BASE) and len(policy._planned) == 2
    policy.record(first, 0, 0.01)
    assert policy.mode == "off" and list(policy._planned) == [("draft", BASE)]
    policy.record(second, 0, 0.01)  # learnt from, no decision (it was planned while on)
    assert policy.mode == "off" and policy.off_steps == 0
    policy.next_length(BASE)
    policy.unplan(1)
    assert not policy._planned


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
    """Requests that pass no draft share one controller, which learns from all of them."""
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
    from flashdraft.bench.oracle import PlantedOracle

    params = SamplingParams(max_tokens=30, ignore_eos=True, seed=11, temperature=0.8)
    prompt = engine.encode_prompt("def add(a, b):")
    plain = engine.generate(prompt, params, draft=0)
    policy = AdaptiveDraft.for_engine(engine)
    oracle = PlantedOracle(prompt + plain.tokens, lambda step: 5, engine.decoder.target.config.vocab_size, "cpu")
    # One slot policy across requests: the target's own continuation planted as guesses, then the random drafter
    # (drafting switches off), then planted again.
    results = []
    for planted in (True, False, True):
        sequence = engine.new_sequence(oracle=oracle if planted else None)
        results.append(engine.generate(prompt, params, draft=policy, sequence=sequence))
        assert results[-1].tokens == plain.tokens
    assert results[0].stats.draft_lengths.get(engine.max_draft, 0) >= policy.config.min_samples
    assert results[0].stats.draft_n_accepted > 0
    assert policy.state()["steps"] == sum(r.stats.steps for r in results)  # it saw every step
    assert json.dumps(policy.state())


def test_a_copy_of_a_policy_keeps_what_it_learnt_and_shares_its_batch_cost(engine):
    """Benchmarks start each prompt from a copy of the policy: the copy has the learnt state, apart from the
    original's, and shares the engine's batch cost (a function of the models, never copied)."""
    import copy

    policy = AdaptiveDraft.for_engine(engine)
    serve_requests(policy, 1, 64, Steady(3))
    policy.set_streams(4)
    twin = copy.deepcopy(policy)
    assert twin.batch_cost is policy.batch_cost and twin.streams == 4 and twin.state() == policy.state()
    serve_requests(twin, 1, 64, Steady(0))
    assert twin.tokens[1].value != policy.tokens[1].value and policy.expected_tokens(BASE) == 4.0
