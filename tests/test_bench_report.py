"""bench report arithmetic (tau, acceptance rate, speedup, pooling) and the text table."""
import re

import pytest

from flashdraft.bench.report import (Measurement, PromptResult, build_report, format_table, prompt_row, summary,
                                     summary_notes, summary_row, table_header, table_row)


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
    assert lines[0].split()[:5] == ["prompt", "tokens", "reps", "base", "tok/s"]
    assert "same-output" in lines[2] and "2.00x" in lines[2] and "yes" in lines[2] and "50.0%" in lines[2]
    assert lines[2].split()[1:3] == ["10", "1"]  # tokens generated, repetitions
    assert "a-very-long-promp~" in lines[3] and "NO" in lines[3]
    assert lines[-1].startswith("all (2)")
    prefill_only = PromptResult("one-token", [run(1, 1.0, steps=0, tokens=[1])],
                                [run(1, 1.0, steps=0, lengths={}, tokens=[1])])
    row = prompt_row(prefill_only, greedy=True)
    assert row["tau"] is None and row["mean_draft_length"] is None and row["acceptance_rate"] is None
    assert table_row(row).split()[-4:] == ["-", "yes", "-", "-"]  # accept, same, spread, draft len
    sampled = table_row(prompt_row(ok, greedy=False))
    assert " - " in sampled  # identical is shown as '-' when sampling


def test_rows_show_tokens_reps_and_the_spread_of_repetitions():
    steady = PromptResult("steady",
                          [run(100, 1000.0, steps=99, tokens=[1]), run(100, 1050.0, steps=99, tokens=[1])],
                          [run(100, 500.0, 90, 45, steps=30, tokens=[1]), run(100, 520.0, 90, 45, steps=30, tokens=[1])])
    shaky = PromptResult("shaky", [run(100, 1000.0, steps=99, tokens=[2]), run(100, 1000.0, steps=99, tokens=[2])],
                         [run(100, 500.0, 90, 45, steps=30, tokens=[2]), run(100, 800.0, 90, 45, steps=30, tokens=[2])])
    a, b = prompt_row(steady, greedy=True), prompt_row(shaky, greedy=True)
    assert a["reps"] == 2 and a["baseline_spread"] == pytest.approx(0.05) and a["dflash_spread"] == pytest.approx(0.04)
    assert not a["noisy"]
    assert b["dflash_spread"] == pytest.approx(0.6) and b["noisy"]  # 200 vs 125 tok/s
    assert table_row(a).split()[1:3] == ["100", "2"] and " 5% " in table_row(a)
    assert "60%!" in table_row(b)
    report = build_report([steady, shaky], greedy=True, config={})
    s = report["summary"]
    assert s["reps"] == 2 and s["noisy_prompts"] == ["shaky"] and s["excluded_prompts"] == []
    assert s["baseline_tokens"] == 200 and s["dflash_tokens"] == 200  # per pass over the prompts
    notes = summary_notes(s)
    assert len(notes) == 1 and notes[0].startswith("warning: repetitions disagree by more than 10%")
    assert "shaky" in notes[0] and notes[0] in format_table(report)


def test_one_repetition_has_no_spread_and_no_warning():
    row = prompt_row(PromptResult("p", [run(10, 100.0, steps=9)], [run(10, 50.0, steps=5)]), greedy=False)
    assert row["baseline_spread"] is None and row["dflash_spread"] is None and row["noisy"] is False
    report = build_report([PromptResult("p", [run(10, 100.0, steps=9)], [run(10, 50.0, steps=5)])], False, {})
    assert summary_notes(report["summary"]) == []


def test_a_whole_pass_that_disagrees_is_noisy_too():
    """Each prompt's repetitions agree, but the machine was slower for the whole second pass."""
    results = [PromptResult(name, [run(100, 1000.0, steps=99), run(100, 1080.0, steps=99)],
                            [run(100, 500.0, 90, 45, steps=30), run(100, 540.0, 90, 45, steps=30)])
               for name in ("a", "b")]
    s = summary(results, greedy=False)
    assert s["noisy_prompts"] == [] and s["baseline_spread"] == pytest.approx(0.08) and not s["noisy"]
    results[1].dflash[1] = run(100, 700.0, 90, 45, steps=30)  # pass 2: 200 tokens in 1.24 s against 1.0 s
    s = summary(results, greedy=False)
    assert s["noisy"] and s["dflash_spread"] == pytest.approx(0.24)
    assert "the overall figures" not in summary_notes(s)[0]  # prompt b is named: its own spread is 40%


def test_prompts_that_generated_nothing_are_flagged_and_left_out_of_the_summary():
    """The target may end its reply at once (EOS first): 0 tokens, 0 tok/s. Such a row is flagged, and the summary
    pools only the prompts that generated tokens."""
    ok = PromptResult("ok", [run(100, 1000.0, steps=99, tokens=[1])], [run(100, 250.0, 90, 45, steps=30, tokens=[1])])
    eos = PromptResult("eos-first", [run(0, 0.5, steps=0, tokens=[])], [run(0, 0.6, steps=0, lengths={}, tokens=[])])
    report = build_report([ok, eos], greedy=True, config={})
    row = report["prompts"][1]
    assert row["empty"] is True and report["prompts"][0]["empty"] is False
    s = report["summary"]
    assert s["prompts"] == 1 and s["excluded_prompts"] == ["eos-first"]
    assert s["baseline_tok_s"] == pytest.approx(100.0) and s["dflash_tok_s"] == pytest.approx(400.0)
    assert s["speedup"] == pytest.approx(4.0) and s["dflash_gen_s"] == pytest.approx(0.25)
    assert s["identical"] is True
    line = table_row(row)
    assert "no tokens: excluded" in line and "tok/s" not in line and not re.search(r"\dx", line)  # no speedup
    cells = line.split()
    # throughput figures, time to first token, tau and acceptance blank; the cached tokens are still a count
    assert cells[1:3] == ["0", "1"] and set(cells[3:9] + cells[10:12]) == {"-"} and cells[9] == "0"
    assert summary_row(s).startswith("all (1 of 2)")
    notes = summary_notes(s)
    assert notes[0].startswith("note: no tokens generated") and "eos-first" in notes[0]
    # Nothing generated anywhere: an empty summary, not a crash.
    nothing = build_report([eos], greedy=True, config={})["summary"]
    assert nothing["prompts"] == 0 and nothing["speedup"] is None and nothing["reps"] == 0
    assert summary_row(nothing).startswith("all (0 of 1)")


def test_header_and_rows_line_up():
    row = prompt_row(PromptResult("p", [run(10, 100.0, steps=9)], [run(10, 50.0, 12, 6, steps=4, lengths={3: 4})]),
                     greedy=True)
    header = table_header().splitlines()[0]
    line = table_row(row)
    for word in ("tokens", "reps", "speedup", "tau"):
        end = header.index(word) + len(word)
        assert line[end - 1] != " " and (end == len(line) or line[end] == " "), word  # right-aligned under it
