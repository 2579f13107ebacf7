"""The effect of each KV cache type on the demo pair (CPU): teacher-forced top-1 agreement with the f32 cache
and the change in next-token loss on three source files of this repository (1,000 tokens each), then greedy
tau, DFlash == plain, and tokens before the first divergence from the f32 cache's output on the bench's code
prompts (128 tokens).

    python scripts/cpu/kv_cache_quality.py
"""
from pathlib import Path

import torch

from flashdraft.bench.prompts import load_prompt_set
from flashdraft.config import SamplingParams
from flashdraft.demo import demo_paths
from flashdraft.engine.generator import Engine

TEXTS = ["tests/tiny_models.py", "tests/test_lossless.py", "src/flashdraft/engine/ngram.py"]
TYPES = [("bf16", "bf16"), ("f16", "f16"), ("q8_0", "q8_0"), ("q5_1", "q5_1"), ("q5_0", "q5_0"),
         ("q4_1", "q4_1"), ("q4_0", "q4_0"), ("q5_0", "q4_1")]


def main() -> None:
    torch.set_num_threads(1)
    target_dir, drafter_dir = demo_paths()
    base = Engine.load(target_dir, None, device="cpu", context_size=1200)
    target = base.decoder.target
    seqs = [torch.tensor(base.encode_prompt(Path(p).read_text())[:1000]) for p in TEXTS]

    def teacher_forced(k_type, v_type):
        top, losses = [], []
        for ids in seqs:
            with torch.no_grad():
                logits, _ = target(ids, torch.arange(len(ids)), target.new_cache(len(ids), k_type, v_type), len(ids))
            top.append(logits.argmax(-1))
            losses.append(torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).item())
        return top, sum(losses) / len(losses)

    ref, ref_loss = teacher_forced(None, None)
    print(f"f32 cache: loss {ref_loss:.4f}")
    for k_type, v_type in TYPES:
        top, loss = teacher_forced(k_type, v_type)
        agree = sum((a == b).sum().item() for a, b in zip(top, ref)) / sum(len(a) for a in ref)
        print(f"{k_type}/{v_type}: top-1 agreement {agree:.4f}, loss {loss:.4f} ({loss - ref_loss:+.4f})")

    params = SamplingParams(max_tokens=128)
    prompts = load_prompt_set("code")
    for k_type, v_type in [(None, None), ("q8_0", "q8_0"), ("q5_0", "q4_1"), ("q4_0", "q4_0")]:
        engine = Engine.load(target_dir, drafter_dir, device="cpu", context_size=1200, cache_type_k=k_type,
                             cache_type_v=v_type, draft_cache_type_k=k_type, draft_cache_type_v=v_type)
        accepted = steps = same = agreed = 0
        for prompt in prompts:
            ids = engine.encode_prompt(messages=prompt.messages)
            dflash = engine.generate(ids, params, engine.max_draft)
            plain = engine.generate(ids, params, 0)
            same += dflash.tokens == plain.tokens
            accepted, steps = accepted + dflash.stats.draft_n_accepted, steps + dflash.stats.steps
            reference = base.generate(ids, params, 0).tokens
            agreed += next((i for i, (a, b) in enumerate(zip(reference, plain.tokens)) if a != b),
                           min(len(reference), len(plain.tokens)))
        print(f"{k_type or 'f32'}/{v_type or 'f32'}: tau {(accepted + steps) / steps:.2f}, DFlash == plain on "
              f"{same}/{len(prompts)} prompts, {agreed} tokens before the first divergence from the f32 cache")


if __name__ == "__main__":
    main()
