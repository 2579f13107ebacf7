"""The random-weight GGUF files of ../shared/llamacpp-bench/make_gguf.py (the files llama.cpp is measured on in the
side by side) load in flashdraft and generate: every shape it has in its tiny form (the real shapes' metadata,
tokenizer and type recipes at small widths) in every type it writes. Skipped where that folder is not beside the
checkout (set FLASHDRAFT_LLAMACPP_BENCH to its path)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine
from flashdraft.loading.gguf import GGUFFile
from flashdraft.quant import QuantEmbedding, QuantLinear, dequantize, q4k_columns, q6k_lanes

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(os.environ.get("FLASHDRAFT_LLAMACPP_BENCH", ROOT.parent / "shared" / "llamacpp-bench"))
MAKE_GGUF = BENCH / "make_gguf.py"
pytestmark = pytest.mark.skipif(not MAKE_GGUF.is_file(), reason=f"{MAKE_GGUF} not found")
TINY = {"tiny-qwen3": "qwen3-8b", "tiny-gemma4": "gemma-4-31b"}  # tiny shape -> the real one it stands for
TYPES = ["f32", "bf16", "q4_k_m", "q4_k_s", "q4_k"]


def make_gguf_module():
    spec = importlib.util.spec_from_file_location("make_gguf", MAKE_GGUF)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # numpy only: gguf-py is imported by its main()
    return module


@pytest.fixture(scope="module")
def mg():
    return make_gguf_module()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every tiny shape in every type, written by make_gguf.py itself (gguf-py: the installed package)."""
    out = tmp_path_factory.mktemp("make_gguf")
    site = Path(gguf.__file__).resolve().parents[1]
    paths = {}
    for shape in TINY:
        for ftype in TYPES:
            path = out / f"{shape}-{ftype}.gguf"
            proc = subprocess.run([sys.executable, str(MAKE_GGUF), "--shape", shape, "--type", ftype, "-o", str(path),
                                   "--gguf-py", str(site), "--verify"], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            paths[shape, ftype] = path
    return paths


def test_the_tiny_shapes_stand_for_the_real_ones(mg):
    """The tiny shapes differ from the real ones only in sizes: same architecture, tying and layer pattern keys."""
    for tiny, real in TINY.items():
        t, r = mg.SHAPES[tiny], mg.SHAPES[real]
        assert set(t) == set(r) and t["arch"] == r["arch"] and t["tied"] == r["tied"]
        if r["arch"] == "gemma4":
            assert t["full_every"] < t["layers"] and t["partial_rotary"] == r["partial_rotary"]


@pytest.mark.parametrize("ftype", TYPES)
@pytest.mark.parametrize("shape", list(TINY))
def test_make_gguf_files_load_and_generate(mg, files, shape, ftype):
    path = files[shape, ftype]
    s = mg.SHAPES[shape]
    plan = {name: q for name, _, _, q in mg.assign_types(mg.tensor_list(s), s, ftype)}
    engine = Engine.load(path, device="cpu", context_size=128)
    target, cfg = engine.decoder.target, engine.decoder.target.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (s["vocab"], s["hidden"], s["layers"])
    assert cfg.tie_word_embeddings == s["tied"]

    # every matrix kept in the type make_gguf.py gave it, its blocks dequantizing to gguf-py's values
    g = GGUFFile(path)
    quant = {m.blocks.data_ptr(): m for m in target.modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    want = {q for q in plan.values() if q not in ("F32", "BF16")}
    # Q6_K in lane order, Q4_K of whole 256-row chunks super-block-major (Q4_K_COLUMNS)
    assert {q4k_columns.file_type(m.qtype) for m in quant.values()} == {q6k_lanes.kept_qtype(q) for q in want}
    emb = target.model.embed_tokens
    if plan["token_embd.weight"] in ("F32", "BF16"):
        assert not quant and emb.weight.dtype == torch.float32
    else:
        assert isinstance(emb, QuantEmbedding) and emb.qtype == q6k_lanes.kept_qtype(plan["token_embd.weight"])
        ref = gguf.quants.dequantize(g.tensors["token_embd.weight"].data[:4],
                                     gguf.GGMLQuantizationType[plan["token_embd.weight"]])
        assert np.array_equal(dequantize(emb.blocks[:4], emb.qtype).numpy(), ref)
    counts = {}
    for q in plan.values():
        counts[q] = counts.get(q, 0) + 1
    blocks = {}
    for m in quant.values():
        blocks[q4k_columns.file_type(m.qtype)] = blocks.get(q4k_columns.file_type(m.qtype), 0) + 1
    for q in want:  # a tied head shares the embedding's blocks: one tensor in the file, one set of blocks here
        assert blocks[q6k_lanes.kept_qtype(q)] == counts[q], (q, blocks, counts)

    # the synthetic SentencePiece vocabulary has no piece a text can form: BOS, then the bytes of the space prefix
    # (U+2581) and of every character; byte tokens decode to their bytes (the prefix too, as in llama.cpp)
    tok = engine.tokenizer
    ids = tok.encode("Hi\n")
    assert ids == [1, 3 + 0xE2, 3 + 0x96, 3 + 0x81, 3 + ord("H"), 3 + ord("i"), 3 + ord("\n")]
    assert tok.decode(ids) == "\u2581Hi\n" and engine.eos_ids == {2}

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = engine.generate(ids, params, 0)
    assert len(first.tokens) == 6 and all(0 <= t < s["vocab"] for t in first.tokens)
    assert engine.generate(ids, params, 0).tokens == first.tokens
