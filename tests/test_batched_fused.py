"""Batched steps on the GPU's layer path (issue #23): several sequences' rows through the fused few-row kernels
(skinny GEMM over more 16-row tiles, qkv_prep and decode_attention per sequence), eager and graphed (one graph per
composition of the steps), each row's bits those of its sequence's pass alone. Triton's interpreter runs the
kernels on the CPU; InlineGraphs stands in for CUDA graphs."""
from types import SimpleNamespace

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"

pytest.importorskip("triton")

from triton_interpreter import interpret_layer_kernels  # noqa: E402

from flashdraft.config import SamplingParams  # noqa: E402
from flashdraft.engine.generator import Engine  # noqa: E402
from test_lossless import InlineGraphs  # noqa: E402
from tiny_models import build_drafter, build_target  # noqa: E402

interpret_layer_kernels()

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
PROMPTS = [[5, 9, 33, 7, 20], [8, 4, 4, 4, 11, 12, 13]]
BLOCK = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batched_fused")
    target_dir = build_target(root / "t", family="qwen3", layers=2, seed=12)
    return target_dir, build_drafter(root / "d", target_dir, block_size=BLOCK, seed=12)


def _engine(pair, slots: int, **options) -> Engine:
    return Engine.load(*pair, device=DEVICE, dtype=torch.float32, context_size=96, gemm="triton",
                       attention="triton", slots=slots, **options)


@pytest.fixture(scope="module")
def engine(pair):
    """Four slots: the few-row passes take four blocks' rows."""
    return _engine(pair, slots=4)


def test_the_plan_takes_every_slots_block_and_the_decoder_batches_fused_layers(engine, pair):
    dec = engine.decoder
    assert dec.plan.max_rows == 16 and dec.fused_target and dec.few_rows_batched and dec.batches
    assert all(layer.fused_rows == 16 for layer in dec.drafter.layers)
    assert _engine(pair, slots=8).decoder.plan.max_rows == 32
    with pytest.raises(ValueError, match="slots must be at least 1"):
        _engine(pair, slots=0)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise on the GPU, where a row's products do not depend on the rows beside it or its place in a 16-row
    tile; under the interpreter, numpy's products round a row by its place in the tile (BLAS edge panels), so there
    only close."""
    if ON_CUDA:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_target_rows_over_segments_are_each_sequences_alone(engine):
    """Three sequences' rows (5 + 4 + 1) in one fused pass: each row's logits and taps are its sequence's pass
    alone (bitwise on the GPU), and each cache gets the same rows."""
    target, dec = engine.decoder.target, engine.decoder
    g = torch.Generator().manual_seed(3)
    caches = {way: [target.new_cache(64) for _ in range(3)] for way in ("alone", "batched")}
    for i in range(3):
        for way in caches:
            for t in caches[way][i].k + caches[way][i].v:
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(DEVICE))
    segments, alone, tokens, positions = [], [], [], []
    for i, (start, rows) in enumerate([(7, 5), (20, 4), (3, 1)]):
        t = torch.randint(0, target.config.vocab_size, (rows,), generator=g).to(DEVICE)
        p = torch.arange(start, start + rows, device=DEVICE)
        with torch.inference_mode():
            alone.append(target(t, p, caches["alone"][i], start + rows, dec.tap_ids))
        segments.append((rows, caches["batched"][i], start + rows))
        tokens.append(t)
        positions.append(p)
    with torch.inference_mode():
        logits, taps = target.forward_segments(torch.cat(tokens), torch.cat(positions), segments, dec.tap_ids)
    at = 0
    for (rows, _, _), (ref_logits, ref_taps) in zip(segments, alone):
        _same(logits[at:at + rows], ref_logits)
        _same(taps[at:at + rows], ref_taps)
        assert torch.equal(logits[at:at + rows].argmax(-1), ref_logits.argmax(-1))
        at += rows
    assert torch.equal(logits[:5], alone[0][0])  # the first rows have the same places in their tile as alone
    for a, b in zip(caches["alone"], caches["batched"]):
        for x, y in zip(a.k + a.v, b.k + b.v):
            _same(x, y)


def test_drafter_passes_over_segments_are_each_sequences_alone(engine):
    """The drafter's fused context projection and block pass for two sequences at once write and give what each
    sequence's own calls do."""
    drafter, target = engine.decoder.drafter, engine.decoder.target
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    g = torch.Generator().manual_seed(5)
    caches = {way: [drafter.new_cache(64) for _ in range(2)] for way in ("alone", "batched")}
    starts = [9, 20]
    contexts = [(torch.randn(3, width, generator=g).to(DEVICE), torch.arange(s - 3, s, device=DEVICE)) for s in starts]
    blocks = [torch.randn(BLOCK, target.config.hidden_size, generator=g).to(DEVICE) for _ in starts]
    with torch.inference_mode():
        for (taps, positions), cache in zip(contexts, caches["alone"]):
            drafter.add_context(taps, positions, cache)
        drafter.add_context_segments([(taps, positions, cache) for (taps, positions), cache
                                      in zip(contexts, caches["batched"])])
        alone = [drafter(block, torch.arange(s, s + BLOCK, device=DEVICE), cache, s + BLOCK)
                 for block, s, cache in zip(blocks, starts, caches["alone"])]
        batched = drafter.forward_segments(torch.cat(blocks), torch.cat([torch.arange(s, s + BLOCK, device=DEVICE)
                                                                         for s in starts]),
                                           [(cache, s + BLOCK, None) for cache, s in zip(caches["batched"], starts)])
    _same(batched, torch.cat(alone))
    for a, b in zip(caches["alone"], caches["batched"]):
        for x, y in zip(a.k + a.v, b.k + b.v):
            _same(x, y)


def _alone(engine, prompt, drafts):
    dec = engine.decoder
    seq = dec.new_sequence()
    dec.prefill(seq, prompt, GREEDY, 0)
    for n in drafts:
        dec.collect(seq, dec.launch(seq, n))
    return seq.tokens[len(prompt):]


ROUNDS = [(BLOCK - 1, 0), (0, BLOCK - 1)]  # one sequence drafting while the other decodes plainly, then the other way


@pytest.fixture(scope="module")
def alone(engine):
    """Each sequence's tokens stepping alone (eagerly) through ROUNDS."""
    return [_alone(engine, p, [r[i] for r in ROUNDS]) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_batched_fused_steps_give_each_sequence_its_tokens_alone(engine, alone, graphed, monkeypatch):
    """Two sequences stepped together twice (ROUNDS): each commits the tokens it commits alone; graphed, as one
    graph per composition. (The decoder's orchestration of batched steps, oracles and many rounds are tested on
    the module path: test_batched_step.)"""
    dec = engine.decoder
    if graphed:
        monkeypatch.setattr(dec, "graphs", InlineGraphs())
    seqs = [dec.new_sequence() for _ in range(2)]
    for seq, p in zip(seqs, PROMPTS):
        dec.prefill(seq, p, GREEDY, 0)
    for drafts in ROUNDS:
        launched = [dec.launch(seq, n, defer=True) for seq, n in zip(seqs, drafts)]
        assert all(step.deferred for step in launched)
        assert dec.flush() == 2
        for seq, step in zip(seqs, launched):
            dec.collect(seq, step)
    assert [seq.tokens[len(p):] for seq, p in zip(seqs, PROMPTS)] == alone
    if graphed:
        assert dec.graphs.keys.count("batch") == 2


def test_steps_beyond_the_few_row_passes_run_in_groups(engine):
    """Deferred steps go in groups whose passes fit the fused path's rows (16 here: four blocks of 4, or plain
    steps' single rows), in order: past it a pass would take the module path, whose rows need not round as alone."""
    dec = engine.decoder
    steps = [SimpleNamespace(n=BLOCK - 1 if kind == "d" else 0, T=BLOCK if kind == "d" else 1) for kind in "ddpddpdd"]
    assert [[id(d) for d in group] for group in dec._batches(steps)] == [[id(d) for d in steps[:4]],
                                                                       [id(d) for d in steps[4:8]]]
    plain = [SimpleNamespace(n=0, T=1) for _ in range(20)]
    assert [len(group) for group in dec._batches(plain)] == [16, 4]
    assert dec._batches([]) == []


def test_graphed_batched_steps_keep_their_segment_tables_as_constants(engine, alone, monkeypatch):
    """A graphed batched step's passes launch each attention kernel once for all sequences, with the segment
    tables made outside capture (a copy from the host cannot be captured), once per graph, and kept with it: the
    passes never make their own, and a replay makes none."""
    dec = engine.decoder
    monkeypatch.setattr(dec, "graphs", InlineGraphs())
    made, segment_tables = [], dec._segment_tables

    def counted_tables(*args):
        made.append(args)
        return segment_tables(*args)

    monkeypatch.setattr(dec, "_segment_tables", counted_tables)
    given = []
    for model in (dec.target, dec.drafter):
        def spy(*args, _forward=model.forward_segments, **kwargs):
            given.append(kwargs.get("table") is not None)
            return _forward(*args, **kwargs)
        monkeypatch.setattr(model, "forward_segments", spy)
    seqs = [dec.new_sequence() for _ in range(2)]
    for seq, p in zip(seqs, PROMPTS):
        dec.prefill(seq, p, GREEDY, 0)
    for drafts in [(BLOCK - 1, BLOCK - 1)] + [(0, 0)] * 4:
        launched = [dec.launch(seq, n, defer=True) for seq, n in zip(seqs, drafts)]
        dec.flush()
        for seq, step in zip(seqs, launched):
            dec.collect(seq, step)
    # every pass of two sequences was given a table (a drafter pass in the first step only)
    assert len(given) >= 5 + 2 and all(given)
    # tables made once per graph, none at a replay
    graphs = [key for key in dec.graphs.graphs if key[0] == "batch"]
    assert len(made) == len(graphs) < dec.graphs.keys.count("batch") == 5
    tables = [dec.target.segment_table([(1, seq.target_cache, 32) for seq in seqs]),
              dec.drafter.segment_table([(seq.draft_cache, 32, None) for seq in seqs])]
    for table, rows in zip(tables, (1, BLOCK)):
        assert table is not None and table[:2].tolist() == [0, rows]


def test_segment_tables_refuse_caches_one_launch_cannot_serve(engine):
    """One launch serves caches of the first one's shape, strides and dtype at a fixed offset from it: a cache of
    another capacity gets no table (the passes then launch the kernels per sequence)."""
    target = engine.decoder.target
    same = [target.new_cache(64), target.new_cache(64)]
    table = target.segment_table([(3, same[0], 10), (2, same[1], 10)])
    assert table is not None and table.shape == (2 * 4 + 5 * 2,)
    assert table[:8].view(2, 4)[:, :2].tolist() == [[0, 3], [3, 2]]
    assert table[8:].view(5, 2)[:3].abs().sum() == 0  # the first segment's rows: its own caches
    offset = (same[1].k[0].data_ptr() - same[0].k[0].data_ptr()) // same[0].k[0].element_size()
    assert table[8:].view(5, 2)[3:, 0].tolist() == [offset, offset]
    assert target.segment_table([(3, same[0], 10), (2, target.new_cache(48), 10)]) is None
