"""Gemma DFlash drafters: z-lab's folder layout, per-layer masks, the block-embedding choice, lossless decoding."""
import json

import pytest
import torch
from test_gemma4_tiny import build_gemma4_target, build_gemma_drafter

from flashdraft.config import ConfigError, SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.models import load_drafter, load_target
from flashdraft.models.gemma4.model import RING_OVERHANG
from flashdraft.models.gemma4.drafter import Gemma4DFlashDrafter

TARGET_WINDOW, DRAFT_WINDOW = 8, 6


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_gemma4_target(tmp_path_factory.mktemp("g4_target"), moe=True, window=TARGET_WINDOW, seed=7)[0]


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir, 0, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target_dir):
    return build_gemma_drafter(tmp_path_factory.mktemp("g4_drafter"), target_dir, window=DRAFT_WINDOW)


def _context(drafter, target, n, seed=0):
    """A drafter cache holding n rows of projected context from random target taps."""
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(n, len(drafter.config.target_layer_ids) * target.config.hidden_size, generator=g)
    cache = drafter.new_cache(n + drafter.block_size + 16)
    drafter.add_context(taps, torch.arange(n), cache)
    return cache


def _draft(drafter, target, cache, start, block):
    B = block.shape[0]
    with torch.no_grad():
        return drafter(target.embed(block), torch.arange(start, start + B), cache, start + B)


def test_gemma_drafter_folder_loads(drafter_dir, target):
    drafter = load_drafter(drafter_dir, target, 64)
    cfg = drafter.config
    assert isinstance(drafter, Gemma4DFlashDrafter)
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert cfg.sliding_window == DRAFT_WINDOW and cfg.final_logit_softcapping == 3.0
    assert cfg.layer_causal == [True, True, False]  # sliding layers causal, the full layer not
    assert cfg.block_embedding_scale == "target" and cfg.mask_token_id == 4
    assert type(cfg).from_dict(cfg.to_dict()) == cfg  # written back in the same layout


def test_sliding_drafter_layers_are_causal(tmp_path, target_dir, target):
    """With every layer sliding, a block row never sees later block rows."""
    folder = build_gemma_drafter(tmp_path, target_dir, layers=2, window=DRAFT_WINDOW,
                                 layer_types=["sliding_attention"] * 2)
    drafter = load_drafter(folder, target, 64)
    cache = _context(drafter, target, 20)
    block = torch.tensor([7] + [4] * 7)
    a = _draft(drafter, target, cache, 20, block)
    b = _draft(drafter, target, cache, 20, torch.cat([block[:4], torch.tensor([9, 10, 11, 12])]))
    assert torch.allclose(a[:4], b[:4], atol=1e-6)
    assert not torch.allclose(a[4:], b[4:], atol=1e-4)


def test_sliding_drafter_layers_see_only_their_window(tmp_path, target_dir, target):
    folder = build_gemma_drafter(tmp_path, target_dir, layers=2, window=DRAFT_WINDOW,
                                 layer_types=["sliding_attention"] * 2)
    drafter = load_drafter(folder, target, 64)
    block = torch.tensor([7] + [4] * 7)
    a = _draft(drafter, target, _context(drafter, target, 20, seed=0), 20, block)
    cache = _context(drafter, target, 20, seed=0)
    old = _context(drafter, target, 20, seed=1)
    reach = 20 - DRAFT_WINDOW + 1  # the first block row (position 20) reaches back to this position
    for i in range(len(drafter.layers)):  # replace context older than any window with something else
        cache.k[i][:, :reach] = old.k[i][:, :reach]
        cache.v[i][:, :reach] = old.v[i][:, :reach]
    assert torch.allclose(a, _draft(drafter, target, cache, 20, block), atol=1e-6)
    cache.k[0][:, reach] += 1.0  # the oldest row inside the window matters
    assert not torch.allclose(a[0], _draft(drafter, target, cache, 20, block)[0], atol=1e-4)


def test_full_drafter_layer_is_non_causal(drafter_dir, target):
    drafter = load_drafter(drafter_dir, target, 64)
    cache = _context(drafter, target, 20)
    block = torch.tensor([7] + [4] * 7)
    a = _draft(drafter, target, cache, 20, block)
    b = _draft(drafter, target, cache, 20, torch.cat([block[:7], torch.tensor([12])]))
    assert not torch.allclose(a[0], b[0], atol=1e-5)  # slot 0 sees the last block token through the full layer


def test_graph_style_drafter_call_is_exact(drafter_dir, target):
    """As under CUDA graphs: kv_len rounded up past the block, with a mask hiding the rows after it."""
    drafter = load_drafter(drafter_dir, target, 64)
    block = torch.tensor([7] + [4] * 7)
    exact = _draft(drafter, target, _context(drafter, target, 20), 20, block)
    cache = _context(drafter, target, 20)
    cache.k[0][:, 28:] = 5.0  # junk past the block must stay hidden
    positions = torch.arange(20, 28)
    with torch.no_grad():
        padded = drafter(target.embed(block), positions, cache, 32, torch.arange(32)[None, :] <= positions[-1:, None])
    assert torch.allclose(exact, padded, atol=1e-5)


def test_block_embedding_scale_choice(tmp_path, target_dir, target, drafter_dir):
    """"target" embeds the block as the target's first layer sees it (sqrt(hidden)); "none" uses raw rows."""
    scaled = load_drafter(drafter_dir, target, 64)
    raw = json.loads((drafter_dir / "config.json").read_text())
    raw["dflash_config"]["block_embedding_scale"] = "none"
    for f in drafter_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    unscaled = load_drafter(tmp_path, target, 64)
    block = torch.tensor([7] + [4] * 7)
    cache = _context(scaled, target, 20)
    with torch.no_grad():
        plain_rows = target.model.embed_tokens(block)
        expected = scaled(plain_rows, torch.arange(20, 28), cache, 28)
        got = unscaled(target.embed(block), torch.arange(20, 28), cache, 28)
        with_scale = scaled(target.embed(block), torch.arange(20, 28), cache, 28)
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(with_scale, expected, atol=1e-3)
    raw["dflash_config"]["block_embedding_scale"] = "sqrt"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="block_embedding_scale"):
        load_drafter(tmp_path, target, 64)


def test_sliding_drafter_needs_a_window(tmp_path, target_dir, target):
    folder = build_gemma_drafter(tmp_path, target_dir)
    raw = json.loads((folder / "config.json").read_text())
    del raw["sliding_window"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="sliding_window"):
        load_drafter(folder, target, 64)


def _prompts(engine):
    text = "def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i)\n"
    chat = engine.encode_prompt(messages=[{"role": "user", "content": text * 3}])
    long = engine.encode_prompt(prompt="The quick brown fox jumps over the lazy dog.\n" * 9)
    return [chat, long]


@pytest.mark.parametrize("dense", [False, True], ids=["moe", "dense"])
def test_greedy_dflash_equals_target_alone(tmp_path, dense, target_dir, drafter_dir):
    """Prompts and outputs longer than both windows and the target's ring; guesses partly replaced by the target's
    own tokens so that every acceptance length, and so every rollback depth, occurs."""
    if dense:
        target_dir = build_gemma4_target(tmp_path / "t", moe=False, window=TARGET_WINDOW, seed=3)[0]
        drafter_dir = build_gemma_drafter(tmp_path / "d", target_dir, window=DRAFT_WINDOW, block_size=6)
    engine = Engine.load(target_dir, drafter_dir, device="cpu", dtype=torch.float32, context_size=256)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in _prompts(engine):
        assert len(prompt) > max(TARGET_WINDOW, DRAFT_WINDOW)
        plain = engine.generate(prompt, params, draft=0)
        assert len(prompt) + len(plain.tokens) > TARGET_WINDOW + RING_OVERHANG
        truth = prompt + plain.tokens
        steps = iter(range(1000))

        def oracle(start, guesses):
            k = next(steps) % (len(guesses) + 1)  # the first k guesses right, the rest the drafter's
            right = torch.tensor((truth + [0] * 64)[start + 1:start + 1 + k], dtype=guesses.dtype)
            return torch.cat([right, guesses[k:]])

        drafted = engine.generate(prompt, params, draft=engine.max_draft, sequence=engine.new_sequence(oracle=oracle))
        assert drafted.tokens == plain.tokens
        assert drafted.stats.draft_n_accepted > 0


@pytest.mark.parametrize("window", [3, 10])
def test_window_cache_gives_what_the_last_n_positions_give(drafter_dir, target, window):
    """--spec-dflash-cross-ctx: a Gemma drafter over a ring of the last N context positions (its sliding layers
    causal and windowed by the positions the ring's rows hold) gives what a full cache gives with the older
    positions hidden."""
    drafter = load_drafter(drafter_dir, target, 64)
    g = torch.Generator().manual_seed(1)
    n, B = 30, drafter.block_size
    taps = torch.randn(n, len(drafter.config.target_layer_ids) * target.config.hidden_size, generator=g)
    ring = drafter.new_cache(n + B + 16, window=window)
    assert type(ring).__name__ == "WindowKVCache" and ring.capacity == window + B
    drafter.add_context(taps, torch.arange(n), ring)
    full = drafter.new_cache(n + B + 16)
    drafter.add_context(taps[n - window:], torch.arange(n - window, n), full)
    block = torch.tensor([7] + [4] * (B - 1))
    positions = torch.arange(n, n + B)
    with torch.no_grad():
        got = drafter(target.embed(block), positions, ring, ring.kv_len(n + B))
        keys = torch.arange(n + B)
        want = drafter(target.embed(block), positions, full, n + B, (keys >= n - window)[None, :])
    assert torch.allclose(got, want, atol=1e-5)


def test_greedy_dflash_with_a_drafter_window_equals_target_alone(target_dir, drafter_dir):
    engine = Engine.load(target_dir, drafter_dir, device="cpu", dtype=torch.float32, context_size=256,
                         draft_window=4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in _prompts(engine):
        plain = engine.generate(prompt, params, draft=0)
        drafted = engine.generate(prompt, params, draft=engine.max_draft)
        assert drafted.tokens == plain.tokens and drafted.stats.draft_n > 0
