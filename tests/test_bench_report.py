"""bench report arithmetic (tau, acceptance rate, speedup, pooling) and the text table."""
import pytest

from flashdraft.bench.report import (Measurement, PromptResult, build_report, format_table, prompt_row, summary,
                                     table_row)


def run(n, ms, draft_n=0, accepted=0, steps=None, lengths=None, tokens=None, text="out"):
    return Measurement(predicted_n=n, predicted_ms=ms, prompt_n=20, prompt_ms=5.0, text=text, draft_n=draft_n,
                       draft_n_accepted=accepted, steps=steps, draft_lengths=lengths, tokens=tokens)


def test_throughput_is_pooled_over_repetitions_and_speedup_is_the_ratio():
    result = PromptResult("p", baseline=[run(100, 2000.0, steps=99), run(100, 3000.0, steps=99)],
                          dflash=[run(100, 500.0, 120, 60, steps=40), run(60, 500.0, 80, 30, steps=30)])
    row = prompt_row(result, greedy=False)
    assert row["baseline_tok_s"] == pytest.approx(200 / 5.0)      # 200 tokens in 5 s
    assert row["dflash_tok_s"] == pytest.approx(160 / 1.0)
    assert row["speedup"] == pytest.approx(160 / 40)
    assert row["baseline_gen_s"] == pytest.approx(2.5)             # mean per repetition
    assert row["dflash_gen_s"] == pytest.approx(0.5)
    assert row["baseline_tokens"] == 100 and row["dflash_tokens"] == 80


def test_tau_and_acceptance_rate():
    result = PromptResult("p", baseline=[run(100, 1000.0, steps=99)],
                          dflash=[run(100, 400.0, draft_n=120, accepted=60, steps=40, lengths={3: 40})])
    row = prompt_row(result, greedy=True)
    assert row["tau"] == pytest.approx((60 + 40) / 40)            # accepted guesses + 1 per step
    assert row["acceptance_rate"] == pytest.approx(60 / 120)
    assert row["draft_n"] == 120 and row["draft_n_accepted"] == 60
    assert row["mean_draft_length"] == pytest.approx(3.0)
    assert row["draft_lengths"] == {"3": 40}


def test_tau_estimated_from_tokens_when_steps_are_unknown():
    # A server reports no steps: the prefill commits 1 token and each step accepted+1, so steps = n - 1 - accepted.
    m = run(101, 100.0, draft_n=150, accepted=70)
    assert m.decode_steps == 30
    row = prompt_row(PromptResult("p", [run(101, 400.0)], [m]), greedy=False)
    assert row["tau"] == pytest.approx(100 / 30)
    assert row["draft_lengths"] is None and row["mean_draft_length"] == pytest.approx(5.0)


def test_no_drafting_gives_tau_one_and_no_acceptance_rate():
    row = prompt_row(PromptResult("p", [run(10, 100.0, steps=9)], [run(10, 100.0, steps=9, lengths={0: 9})]),
                     greedy=True)
    assert row["tau"] == 1.0
    assert row["acceptance_rate"] is None
    assert row["speedup"] == pytest.approx(1.0)


def test_speedup_undefined_when_baseline_took_no_time():
    row = prompt_row(PromptResult("p", [run(0, 0.0, steps=0)], [run(5, 10.0, steps=5)]), greedy=False)
    assert row["baseline_tok_s"] == 0.0 and row["speedup"] is None


def test_identical_compares_token_ids_then_text_and_is_null_when_sampling():
    same = PromptResult("p", [run(3, 1.0, tokens=[1, 2, 3])], [run(3, 1.0, tokens=[1, 2, 3])])
    diff = PromptResult("p", [run(3, 1.0, tokens=[1, 2, 3])], [run(3, 1.0, tokens=[1, 2, 4])])
    texts = PromptResult("p", [run(3, 1.0, text="abc")], [run(3, 1.0, text="abd")])
    assert prompt_row(same, greedy=True)["identical"] is True
    assert prompt_row(diff, greedy=True)["identical"] is False
    assert prompt_row(texts, greedy=True)["identical"] is False
    assert prompt_row(same, greedy=False)["identical"] is None


def test_summary_pools_all_prompts():
    a = PromptResult("a", [run(100, 1000.0, steps=99)], [run(100, 250.0, 90, 45, steps=30, lengths={3: 30},
                                                              tokens=[1])])
    b = PromptResult("b", [run(50, 1000.0, steps=49)], [run(50, 750.0, 60, 15, steps=20, lengths={3: 10, 0: 10},
                                                             tokens=[2])])
    a.baseline[0].tokens, b.baseline[0].tokens = [1], [2]
    s = summary([a, b], greedy=True)
    assert s["prompts"] == 2
    assert s["baseline_tok_s"] == pytest.approx(150 / 2.0)
    assert s["dflash_tok_s"] == pytest.approx(150 / 1.0)
    assert s["speedup"] == pytest.approx(2.0)
    assert s["tau"] == pytest.approx((45 + 15 + 50) / 50)
    assert s["acceptance_rate"] == pytest.approx(60 / 150)
    assert s["draft_lengths"] == {"0": 10, "3": 40}
    assert s["baseline_gen_s"] == pytest.approx(2.0) and s["dflash_gen_s"] == pytest.approx(1.0)
    assert s["identical"] is True  # each prompt agrees with itself; prompts differ from each other


def test_table_shows_rows_summary_and_missing_values():
    ok = PromptResult("same-output", [run(10, 100.0, steps=9, tokens=[1])],
                      [run(10, 50.0, 12, 6, steps=4, lengths={3: 4}, tokens=[1])])
    bad = PromptResult("a-very-long-prompt-name-indeed", [run(10, 100.0, steps=9, tokens=[1])],
                       [run(10, 50.0, steps=9, lengths={0: 9}, tokens=[2])])
    text = format_table(build_report([ok, bad], greedy=True, config={}))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["prompt", "base", "tok/s"]
    assert "same-output" in lines[2] and "2.00x" in lines[2] and "yes" in lines[2] and "50.0%" in lines[2]
    assert "a-very-long-promp~" in lines[3] and "NO" in lines[3]
    assert lines[-1].startswith("all (2)")
    prefill_only = PromptResult("one-token", [run(1, 1.0, steps=0, tokens=[1])],
                                [run(1, 1.0, steps=0, lengths={}, tokens=[1])])
    row = prompt_row(prefill_only, greedy=True)
    assert row["tau"] is None and row["mean_draft_length"] is None and row["acceptance_rate"] is None
    assert table_row(row).split()[-4:] == ["-", "-", "yes", "-"]
    sampled = table_row(prompt_row(ok, greedy=False))
    assert " - " in sampled  # identical is shown as '-' when sampling
