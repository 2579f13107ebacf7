"""`flashdraft bench --synthetic SHAPE`: speed at real published shapes with random weights.

The target and drafter have the shapes of published checkpoints and random weights, so no download is needed.
In oracle mode the drafter really runs (its cost is real) but its guesses are replaced by the target's own
greedy continuation with a planted mismatch (bench.oracle.PlantedOracle), so acceptance, and with it tau,
follows a chosen pattern: tau = k + 1 when k guesses are accepted per step.

The random target is built so that its greedy continuation has huge logit margins: the LM head is a permuted
copy of the embedding and the embedding dominates the residual stream, so the next token is a fixed
permutation of the current one. bf16 rounding differences between a 1-token and a 16-token pass then never
flip an argmax, and the baseline's tokens stay a valid oracle for the DFlash run. Every layer still does its
full work, so the timings are those of a real model of that shape.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from flashdraft.bench.oracle import PlantedOracle
from flashdraft.config import DrafterConfig, ModelConfig, SamplingParams, default_tap_ids
from flashdraft.engine.generator import Engine
from flashdraft.engine.model_prep import resolve_plan
from flashdraft.layers import LayerPlan
from flashdraft.models import DecoderLM, DFlashDrafter

QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rope_theta=1e6, max_position_embeddings=40960)
LLAMA31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  rope_theta=500000.0, max_position_embeddings=131072,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
# name -> (target shape, drafter layers, block size); the drafter layers take the target's shape (z-lab's).
SHAPES = {
    "qwen3-8b": (QWEN3_8B, 5, 16),
    "llama-3.1-8b": (LLAMA31_8B, 5, 10),
    "qwen3-1b": (dict(QWEN3_8B, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8), 2, 16),
    "tiny": (dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048), 2, 8),
}
TAUS = (2, 4, 6, 8, 16)


def build_synthetic(shape: str, device: torch.device, dtype: torch.dtype, context_size: int, seed: int = 0,
                    plan: LayerPlan = LayerPlan()):
    """A random target and drafter of the shape, built with `plan`; the same weights for the same seed."""
    if shape not in SHAPES:
        raise ValueError(f"unknown synthetic shape {shape!r}; choose from {', '.join(SHAPES)}")
    raw, draft_layers, block = SHAPES[shape]
    cfg = ModelConfig.from_dict(raw)
    capacity = context_size + 64
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        target = DecoderLM(cfg, capacity, plan)
    target = target.to_empty(device=device).to(dtype)
    for name, p in target.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name == "model.embed_tokens.weight":
            p.data.normal_(0, 1.0, generator=gen)
        else:
            p.data.normal_(0, 0.002, generator=gen)  # small layer outputs: the embedding dominates the residual
    perm = torch.randperm(cfg.vocab_size, generator=gen, device=device)
    target.lm_head.weight.data.copy_(target.model.embed_tokens.weight.data[perm])
    target.rope = target.rope.__class__(cfg, capacity).to(device)
    target.eval().requires_grad_(False)

    dcfg = DrafterConfig(layers=ModelConfig.from_dict(dict(raw, num_hidden_layers=draft_layers)), block_size=block,
                         mask_token_id=cfg.vocab_size - 1,
                         target_layer_ids=default_tap_ids(cfg.num_hidden_layers, draft_layers),
                         num_target_layers=cfg.num_hidden_layers)
    with torch.device("meta"):
        drafter = DFlashDrafter(dcfg, capacity, plan)
    drafter = drafter.to_empty(device=device).to(dtype)
    for name, p in drafter.named_parameters():
        p.data.fill_(1.0) if name.endswith("norm.weight") else p.data.normal_(0, 0.02, generator=gen)
    drafter.rope = drafter.rope.__class__(dcfg.layers, capacity).to(device)
    drafter.eval().requires_grad_(False)
    return target, drafter


def weight_bytes(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if not n.startswith(skip))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device: torch.device, reps: int = 10, warmup: int = 2) -> float:
    """Median wall time of fn() over reps runs after warmup runs, synchronizing the device around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of 10."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    return 2 * a.numel() * a.element_size() / median_seconds(lambda: b.copy_(a), device) / 1e9


def measure_matmul(device: torch.device, n: int = 8192) -> float:
    """bf16 (CPU: float32) matrix-product rate in TFLOP/s on random data, median of 10."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / median_seconds(lambda: a @ b, device) / 1e12


@dataclass
class SyntheticReport:
    shape: str
    device: str
    variant: str
    bandwidth_gb_s: float
    matmul_tflop_s: float
    target_gb: float
    drafter_gb: float
    lm_head_gb: float
    block_size: int
    context: int = 0              # prompt tokens before decoding (--context; 32 without)
    kv_gb: float = 0.0            # target KV cache read per step at that depth (in the rooflines)
    baseline_tok_s: float = 0.0
    baseline_gb_s: float = 0.0
    baseline_roofline_tok_s: float = 0.0
    decode_step_ms: float = 0.0
    verify_step_ms: float = 0.0
    draft_step_ms: float = 0.0
    dflash: list[dict] = field(default_factory=list)
    variants: dict = field(default_factory=dict)
    sampling: dict | None = None  # temperature, top_k, top_p, min_p, seed of both ways; None: greedy

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def decode_tok_s(result) -> float:
    """Tokens per second of the decode phase (after the prompt; each step ends in a host sync)."""
    s = result.stats
    return (s.predicted_n - 1) / (s.predicted_ms / 1000)




def run(shape: str, device: str | None = None, tokens: int = 256, variants: tuple[str, ...] | None = None,
        taus: tuple[int, ...] = TAUS, log=print, context: int = 0,
        sampling: SamplingParams | None = None) -> SyntheticReport:
    """sampling: the warping settings and seed of both ways (default greedy); with a seed, sampled DFlash gives
    the plain run's tokens (position-keyed noise), which the report's `identical` checks."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if variants is None:
        variants = (("graphs+compiled", "graphs+compiled+triton+attn") if dev.type == "cuda"
                    else ("eager",))
    prompt_len = max(32, context)
    capacity = prompt_len + tokens + 64
    B = SHAPES[shape][2] if shape in SHAPES else 1

    def build(variant: str):
        """The models as the variant runs them: "compiled" = fused q/k/v and gate/up projections plus
        torch.compile'd layers; "triton" = linear layers through the batch-invariant skinny GEMM
        (layers.skinny_gemm) instead of cuBLAS; "attn" = attention of decode/verify/draft passes through
        layers.decode_attention instead of SDPA. The engine's CUDA default is "graphs+compiled+triton+attn"."""
        plan = resolve_plan(dev, "triton" if "triton" in variant else "cublas",
                            "triton" if "attn" in variant else "sdpa", "compiled" in variant, B)
        return build_synthetic(shape, dev, dtype, capacity, plan=plan)

    target, drafter = build(variants[0])
    lm_head = weight_bytes(target.lm_head)
    report = SyntheticReport(
        shape=shape, device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", variant=variants[-1],
        bandwidth_gb_s=measure_bandwidth(dev) if dev.type == "cuda" else measure_bandwidth(dev, 256 << 20),
        matmul_tflop_s=measure_matmul(dev),
        target_gb=(weight_bytes(target, ("model.embed_tokens",))) / 1e9, drafter_gb=weight_bytes(drafter) / 1e9,
        lm_head_gb=lm_head / 1e9, block_size=drafter.block_size, context=prompt_len,
        kv_gb=target.new_cache(1).bytes_per_token() * (prompt_len + tokens / 2) / 1e9)
    log(f"[{shape}] copy bandwidth {report.bandwidth_gb_s:.0f} GB/s, matmul {report.matmul_tflop_s:.0f} TFLOP/s; "
        f"target {report.target_gb:.2f} GB read per step, drafter {report.drafter_gb:.2f} GB, LM head {report.lm_head_gb:.2f} GB"
        f"; {prompt_len} prompt tokens, KV cache {report.kv_gb:.2f} GB read per step (mean over the decode)")
    report.baseline_roofline_tok_s = report.bandwidth_gb_s / (report.target_gb + report.kv_gb)
    prompt = [1 + i % (target.config.vocab_size - 1) for i in range(prompt_len)]
    sampling = sampling or SamplingParams()
    params = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                            min_p=sampling.min_p, seed=0 if sampling.seed is None else sampling.seed,
                            max_tokens=tokens, ignore_eos=True)
    if not params.greedy:
        report.sampling = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                           "min_p": params.min_p, "seed": params.seed}
        log(f"  sampling: T {params.temperature}, top-k {params.top_k}, top-p {params.top_p}, "
            f"min-p {params.min_p}, seed {params.seed}")
    engine = None
    for i, variant in enumerate(variants):
        # each variant over models of its own plan (the last variant's DFlash table is run)
        if i:
            plain = engine = planted = oracle = target = drafter = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            target, drafter = build(variant)
        graphs = "graphs" in variant
        options = dict(context_size=capacity, cuda_graphs=graphs, compile="compiled" in variant)
        # The baseline is the target alone (plain decoding with nothing else loaded); DFlash runs the same target
        # with the drafter, each over its own graphs.
        plain = Engine(target, None, None, **options)
        plain.generate(prompt, params, 0)  # warm-up: captures graphs, compiles kernels
        base = plain.generate(prompt, params, 0)
        engine = Engine(target, None, drafter, **options)
        oracle = PlantedOracle(prompt + base.tokens, lambda s: s % B, target.config.vocab_size, dev)
        planted = engine.new_sequence(oracle=oracle)  # DFlash generates in it, the oracle's guesses planted
        if graphs:
            engine.generate(prompt, params, B - 1, sequence=planted)  # capture every verify length before timing
        tok_s = decode_tok_s(base)
        report.variants[variant] = {"baseline_tok_s": tok_s, "gb_s": tok_s * report.target_gb}
        log(f"  {variant:24s} baseline {tok_s:8.1f} tok/s = {tok_s * report.target_gb:6.0f} GB/s "
            f"({100 * tok_s / report.baseline_roofline_tok_s:.0f}% of roofline {report.baseline_roofline_tok_s:.0f})")
    report.baseline_tok_s = report.variants[variants[-1]]["baseline_tok_s"]
    report.baseline_gb_s = report.baseline_tok_s * report.target_gb
    seq = engine.decoder.new_sequence()
    decoder = engine.decoder
    decoder.prefill(seq, prompt, params, 0)
    def step_ms(fn) -> float:
        return 1000 * median_seconds(fn, dev, reps=30, warmup=1)

    report.decode_step_ms = step_ms(lambda: decoder.target_pass(seq, torch.tensor([1], device=dev), prompt_len))
    report.verify_step_ms = step_ms(lambda: decoder.target_pass(seq, torch.arange(B, device=dev), prompt_len))
    report.draft_step_ms = step_ms(lambda: decoder.draft(seq, B - 1))
    log(f"  decode step {report.decode_step_ms:.3f} ms, verify step ({B} tokens) {report.verify_step_ms:.3f} ms, "
        f"draft step {report.draft_step_ms:.3f} ms")
    step_bytes = (report.target_gb + report.drafter_gb + report.lm_head_gb + report.kv_gb)
    for tau in taus:
        accept = min(tau - 1, B - 1)
        oracle.replan(lambda s, k=accept: k)  # one oracle object: the graphs captured with it serve every pattern
        engine.generate(prompt, params, B - 1, sequence=planted)  # untimed: any capture or compile it needs
        oracle.reset()
        out = engine.generate(prompt, params, B - 1, sequence=planted)
        tok_s = decode_tok_s(out)
        roofline = (accept + 1) * report.bandwidth_gb_s / step_bytes
        row = {"tau_planned": tau if accept + 1 == tau else accept + 1, "tau": out.stats.tau,
               "dflash_tok_s": tok_s, "speedup": tok_s / report.baseline_tok_s, "roofline_tok_s": roofline,
               "roofline_speedup": roofline / report.baseline_roofline_tok_s,
               "identical": out.tokens == base.tokens}
        report.dflash.append(row)
        log(f"  tau {row['tau']:5.2f}: DFlash {tok_s:8.1f} tok/s, speedup {row['speedup']:5.2f}x "
            f"(roofline {roofline:7.0f} tok/s, {row['roofline_speedup']:.2f}x), same tokens as baseline: {row['identical']}")
    return report


def main(args) -> int:
    try:
        sampling = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                  seed=args.seed)
        sampling.validate()
        report = run(args.synthetic, device=args.device, tokens=args.n_predict,
                     log=(lambda s: print(s, file=sys.stderr)) if args.json else print, context=args.context,
                     sampling=sampling)
    except ValueError as e:
        print(f"flashdraft bench: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0
