"""MoE experts multiplied pair by pair from their GGUF blocks (gguf_triton.launch_experts, QuantGemma4Experts'
pair products), on the CPU under Triton's interpreter (a fresh process: TRITON_INTERPRET must be set before Triton
is first imported): each pair's row has the bits of the same row through the one-weight kernel with its expert's
blocks, whatever rows come with it; the experts' module gives a token the same bits in a one-token pass and in a
verify block, and the dequantized module's values."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the kernels run under Triton's interpreter")

CHECK = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from gguf_run import random_blocks
from flashdraft.kernels import gguf_triton as tk
from flashdraft.models.gemma4.gguf import QuantGemma4Experts
from flashdraft.models.gemma4.model import Gemma4Experts
from flashdraft.quant import dequantize, q6k_lanes
from flashdraft.quant.expert_kernels import PAIR_TYPES

assert PAIR_TYPES == set(tk.QTYPE_CODES), sorted(PAIR_TYPES ^ set(tk.QTYPE_CODES))
g = torch.Generator().manual_seed(0)
ids = torch.tensor([3, 0, 3, 4, 1, 2, 3])
for qtype, n, k in (("Q8_0", 48, 64), ("Q4_0", 20, 96), ("Q4_K", 40, 512), ("Q5_K", 24, 256),
                    ("Q6_K_LANES", 32, 256)):
    blocks = torch.stack([random_blocks(qtype, n, k, g, "cpu") for _ in range(5)])
    config = tk.config_for(qtype, n, k)
    configs = [config]
    if (k // config.block_k) % 2 == 0:  # a K split too: partials added by the reduce kernel
        configs.append(tk.QuantConfig(**{**config.__dict__, "split_k": 2}))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, k, generator=g).to(dtype)
        for c in configs:
            y = tk.launch_experts(x, blocks, ids, qtype, c)
            for p in range(7):
                assert torch.equal(y[p:p + 1], tk.launch(x[p:p + 1], blocks[ids[p]], n, qtype, c)), (qtype, p, c)
            assert torch.equal(tk.launch_experts(x[2:3], blocks, ids[2:3], qtype, c), y[2:3]), (qtype, c)
        if dtype == torch.float32:
            ref = torch.stack([x[p] @ dequantize(blocks[ids[p]], qtype).T for p in range(7)])
            assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4), (qtype, (y - ref).abs().max())
# a program writes its own row and no other: the grid's first program alone, over an output of NaNs (under the
# interpreter programs run in order, so a later program would overwrite what an earlier one wrote wrongly)
b8 = torch.stack([random_blocks("Q8_0", 48, 64, g, "cpu") for _ in range(5)])
x8 = torch.randn(7, 64, generator=g)
y = torch.full((7, 48), float("nan"))
tk._quant_matmul_kernel[(1, 1, 1)](x8, b8, y, y, 7, 48, b8.shape[-1], x8.stride(0), y.stride(0), K=64,
                                   QTYPE=tk.QTYPE_CODES["Q8_0"], IEEE=True, UPCAST=True, BLOCK_M=tk.BLOCK_M,
                                   BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, STEPS=1, EVEN_N=False, EVEN_K=True, e_ptr=ids,
                                   stride_e=b8.stride(0), EXPERTS=True)
assert torch.equal(y[:1], tk.launch(x8[:1], b8[ids[0]], 48, "Q8_0")) and y[1:].isnan().all()
for bad, what in ((lambda: tk.launch_experts(x, blocks, ids[:3], "Q6_K_LANES"), "one int expert id a row"),
                  (lambda: tk.launch_experts(x, blocks[0], ids, "Q6_K_LANES"), "uint8 [experts, N, row_bytes]"),
                  (lambda: tk.launch_experts(x, blocks, ids, "Q6_K"), "no kernel reads Q6_K blocks"),
                  (lambda: tk.launch_experts(x, blocks[:0], ids, "Q6_K_LANES"), "uint8 [experts, N, row_bytes]")):
    try:
        bad()
        sys.exit(f"no error for {what}")
    except ValueError as e:
        assert what in str(e), e

# the experts' module: Q4_K gate_up and GGUF Q6_K down (put in lane order), hidden 256, intermediate 256
e, h, m = 6, 256, 256
gate_up = torch.stack([random_blocks("Q4_K", 2 * m, h, g, "cpu") for _ in range(e)])
down_lanes = torch.stack([random_blocks("Q6_K_LANES", h, m, g, "cpu") for _ in range(e)])
down = q6k_lanes.to_gguf(down_lanes.reshape(e * h, -1)).reshape(e, h, -1)
pairs = QuantGemma4Experts((gate_up, "Q4_K"), (down, "Q6_K"), h, m, torch.float32, pair_products=True)
plain = QuantGemma4Experts((gate_up, "Q4_K"), (down, "Q6_K"), h, m, torch.float32)
assert pairs.qtypes == {"gate_up_proj": "Q4_K", "down_proj": "Q6_K_LANES"}, pairs.qtypes
assert torch.equal(pairs.down_proj_blocks, down_lanes)
x = torch.randn(20, h, generator=g)
experts = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(20)])
weights = torch.rand(20, 2, generator=g)
block = pairs(x[:16], weights[:16], experts[:16])  # a verify block's 16 tokens, pair by pair
for t in (0, 7, 15):
    assert torch.equal(pairs(x[t:t + 1], weights[t:t + 1], experts[t:t + 1]), block[t:t + 1]), t
dense = Gemma4Experts.__new__(Gemma4Experts)
torch.nn.Module.__init__(dense)
dense.gate_up_proj, dense.down_proj = plain.gate_up_proj[:], plain.down_proj[:]
assert torch.allclose(block, dense(x[:16], weights[:16], experts[:16]), rtol=1e-4, atol=1e-4)
assert torch.equal(pairs(x, weights, experts), plain(x, weights, experts))  # 20 tokens: the dequantized path
try:
    QuantGemma4Experts((gate_up, "Q4_K"), (down, "Q3_K"), h, m, torch.float32, pair_products=True)
    sys.exit("pair products accepted Q3_K experts")
except ValueError as err:
    assert "down_proj Q3_K" in str(err), err
print("OK")
"""


def test_experts_multiply_pair_by_pair_with_the_one_weight_kernels_bits():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", CHECK, str(ROOT / "scripts" / "gpu")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile's GPU code and the kernels on a GPU")
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-gathered", "Q4_K-Q8_0-pairs"])
def test_compiled_router_and_experts_give_a_token_the_same_bits_alone_and_in_a_verify_block(quantized, monkeypatch):
    """The router and the experts compiled together as the engine compiles a Gemma 4 layer (dynamic shapes; the
    top-k of 8 a constant, as in the engine), at the 26B-A4B's widths (16 experts of its 128): each token of a
    16-token pass has the bits of the same token alone. The experts' weighted sum and the router's renormalisation
    are where torch.compile's GPU code could follow the pass's shape (models.gemma4.model.weigh_choices,
    add_in_order)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "gpu"))
    from gguf_run import random_blocks

    from flashdraft.engine.model_prep import resolve_plan
    from flashdraft.models.gemma4.gguf import QuantGemma4Experts
    from flashdraft.models.gemma4.model import Gemma4Experts, Gemma4Router

    torch._dynamo.reset()
    dev = torch.device("cuda")
    cfg = SimpleNamespace(num_experts=16, top_k_experts=8, hidden_size=2816, moe_intermediate_size=704,
                          rms_norm_eps=1e-6)
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    gen = torch.Generator(device=dev).manual_seed(0)
    router = Gemma4Router(cfg, resolve_plan(dev, block_size=16)).to(dev, torch.bfloat16)
    for name, p in router.named_parameters():
        p.data.normal_(1.0 if "scale" in name else 0.0, 0.3 if "scale" in name else 0.02, generator=gen)
    if quantized:
        gate_up = torch.stack([random_blocks("Q4_K", 2 * inter, hidden, gen, dev) for _ in range(cfg.num_experts)])
        down = torch.stack([random_blocks("Q8_0", hidden, inter, gen, dev) for _ in range(cfg.num_experts)])
        experts = QuantGemma4Experts((gate_up, "Q4_K"), (down, "Q8_0"), hidden, inter, torch.bfloat16,
                                     pair_products=True)
    else:
        experts = Gemma4Experts(cfg).to(dev, torch.bfloat16)
        for p in experts.parameters():
            p.data.normal_(0, 0.02, generator=gen)

    class RoutedExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.experts = router, experts

        def forward(self, h):
            weights, chosen = self.router(h)
            return self.experts(h, weights, chosen)

    compiled = torch.compile(RoutedExperts(), fullgraph=True, dynamic=True)
    h = torch.randn(16, hidden, device=dev, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        block = compiled(h)
        alone = [compiled(h[t:t + 1]) for t in range(16)]
    assert [t for t in range(16) if not torch.equal(alone[t], block[t:t + 1])] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitwise batch invariance is the GPU's question")
def test_compiled_moe_target_at_26b_widths_gives_a_token_its_bits_alone_and_in_a_verify_block(monkeypatch):
    """A 26B-A4B-wide bf16 target (hidden 2816, 128 experts, top-8; a sliding and a full layer, norms not ones) with
    the engine's CUDA plan and compiled layers, as scripts/gpu/gemma4_invariance.py --moe builds it: each of 16
    tokens' logits and last hidden state alone equal the same token's in a 16-token pass. At these widths, compiled
    norms gave rows other bits alone (7 of 16 with six layers on an H100) where a tiny model's did not."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "gpu"))
    import gemma4_invariance as gi
    from gguf_run import FULL, SLIDING

    from flashdraft.engine.model_prep import compile_layers

    torch._dynamo.reset()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    target = gi.build_moe_target(dev, torch.bfloat16, gen, "triton", True, False, [SLIDING, FULL])
    gi.ordinary_norms(target, gen)
    compile_layers(target)
    with torch.inference_mode():
        report = gi.model_check(target, dev, 100, 16, gen)
    assert report["logits"]["rows_unequal"] == 0 and report["hidden"]["rows_unequal"] == 0, report
