"""Drafter training pieces that must agree with the inference path: taps, batched generation, blocks, mask."""
import json

import pytest
import torch

from flashdraft.config import SamplingParams
from flashdraft.models import load_drafter, load_target
from flashdraft.train.blocks import make_blocks, sample_anchors, slot_weights
from flashdraft.train.data import collate, load_prompts, TrainSequence
from flashdraft.train.drafter_setup import resolve_mask_token
from flashdraft.train.target_batched import generate_batch, target_taps


@pytest.fixture(scope="module")
def pair(qwen3_dir, drafter_dir):
    target = load_target(qwen3_dir, 128, "cpu", torch.float32)
    return target, load_drafter(drafter_dir, target, 128)


def test_batched_taps_match_target_forward(pair):
    target, _ = pair
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 300, (40,), generator=g), torch.randint(0, 300, (25,), generator=g)
    padded = torch.zeros(2, 40, dtype=torch.long)
    padded[0], padded[1, :25] = a, b
    taps = target_taps(target, padded, [1, 2])
    for row, seq in ((0, a), (1, b)):
        _, ref = target(seq, torch.arange(len(seq)), target.new_cache(64), len(seq), [1, 2])
        torch.testing.assert_close(taps[row, :len(seq)], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_generation_matches_engine(engine, temperature):
    prompts = [engine.encode_prompt(p) for p in ("def add(a, b):", "Hello", "for i in range(10):\n    print(i)")]
    seeds, budgets = [11, 12, 13], [12, 5, 37]  # 37 > SYNC_EVERY: rows finish between the device-side checks
    outs = generate_batch(engine.decoder.target, prompts, budgets, engine.eos_ids,
                          SamplingParams(temperature=temperature), seeds)
    for prompt, out, seed, budget in zip(prompts, outs, seeds, budgets):
        ref = engine.generate(prompt, SamplingParams(temperature=temperature, max_tokens=budget, seed=seed), draft=0)
        expected = ref.tokens + ([out[-1]] if ref.stop_type == "eos" else [])  # the engine drops the EOS
        assert out == expected


def test_training_forward_equals_inference_drafter(pair):
    """For each anchor, the training pass's block logits equal the inference drafter's on the same context."""
    target, drafter = pair
    B, mask_id = drafter.block_size, drafter.config.mask_token_id
    g = torch.Generator().manual_seed(1)
    seqs = [TrainSequence(torch.randint(0, 300, (36,), generator=g).tolist(), 6),
            TrainSequence(torch.randint(0, 300, (20,), generator=g).tolist(), 4)]
    tokens, loss_mask, lengths = collate(seqs, pad_id=0)
    anchors = torch.tensor([[6, 17, 33], [4, 18, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    taps = target_taps(target, tokens, drafter.config.target_layer_ids)
    blocks = make_blocks(tokens, loss_mask, anchors, valid, B, mask_id)
    with torch.no_grad():
        hidden = drafter.forward_train(target.embed(blocks.tokens), blocks.positions, taps, blocks.mask)
    logits = target.logits(hidden).view(2, 3, B, -1)
    for row in range(2):
        for j in range(3):
            if not valid[row, j]:
                continue
            a = int(anchors[row, j])
            cache = drafter.new_cache(64)
            drafter.add_context(taps[row, :a], torch.arange(a), cache)
            block = torch.full((B,), mask_id)
            block[0] = tokens[row, a]
            with torch.no_grad():
                ref = target.logits(drafter(target.embed(block), torch.arange(a, a + B), cache, a + B))
            torch.testing.assert_close(logits[row, j], ref, rtol=1e-4, atol=1e-4)


def test_blocks_mask_labels_and_anchors():
    tokens = torch.arange(100, 112)[None]  # one sequence of 12 tokens, response from position 4
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 4:] = True
    anchors, valid = sample_anchors(loss_mask, torch.tensor([12]), 50, torch.Generator().manual_seed(0))
    assert anchors[0].tolist() == list(range(4, 11)) and valid.all()  # response positions <= len-2, sorted
    anchors, valid = torch.tensor([[4, 9]]), torch.tensor([[True, True]])
    blk = make_blocks(tokens, loss_mask, anchors, valid, block_size=4, mask_token_id=7)
    assert blk.tokens.tolist() == [[104, 7, 7, 7, 109, 7, 7, 7]]
    assert blk.positions.tolist() == [[4, 5, 6, 7, 9, 10, 11, 12]]
    assert blk.labels.tolist() == [[[105, 106, 107], [110, 111, 111]]]
    assert blk.label_mask.tolist() == [[[True, True, True], [True, True, False]]]  # position 12 is out of range
    m = blk.mask[0]
    assert m.shape == (8, 12 + 8)
    assert m[0, :12].tolist() == [True] * 4 + [False] * 8        # block 0: context strictly before anchor 4
    assert m[5, :12].tolist() == [True] * 9 + [False] * 3        # block 1: context before anchor 9
    assert m[:4, 12:].tolist() == [[True] * 4 + [False] * 4] * 4  # own block only, bidirectional
    assert m[4:, 12:].tolist() == [[False] * 4 + [True] * 4] * 4
    w = slot_weights(16, 7.0)
    assert w[0] == 1.0 and torch.allclose(w[7], torch.tensor(1 / torch.e))


def test_mask_token_resolution(qwen3_dir):
    from flashdraft.config import ModelConfig
    from flashdraft.loading import Tokenizer
    tok, cfg = Tokenizer(qwen3_dir), ModelConfig.from_file(qwen3_dir / "config.json")
    added = json.loads((qwen3_dir / "tokenizer.json").read_text())["added_tokens"]
    mask = next(t["id"] for t in added if t["content"] == "<|mask|>")
    assert resolve_mask_token(tok, cfg) == mask
    assert resolve_mask_token(tok, cfg, 5) == 5
    with pytest.raises(ValueError, match="not a row"):
        resolve_mask_token(tok, cfg, cfg.vocab_size)
    with pytest.raises(ValueError, match="end-of-sequence"):
        resolve_mask_token(tok, cfg, cfg.eos_token_ids[0])


def test_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    recs = load_prompts(f)
    assert [r.text for r in recs] == ["a", None] and recs[1].messages[0]["content"] == "b"
    f.write_text('{"prompt": "a"}\n{"text": 1}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2"):
        load_prompts(f)
    t = tmp_path / "p.txt"
    t.write_text("first prompt\n\nsecond {not json}\n")
    assert [r.text for r in load_prompts(t)] == ["first prompt", "second {not json}"]
    t.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(t)
