"""Held-out acceptance length measured with the real decoding loop (training accuracy alone misleads)."""
from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from flashdraft.config import SamplingParams
from flashdraft.engine.generator import Engine


def measure_tau(target_dir: str | Path, drafter_dir: str | Path, prompts: list[list[int]], max_tokens: int,
                device=None, progress: bool = True) -> dict:
    """Greedy generation with the full draft length on each prompt; tau as the benchmark reports it.

    tau = mean over responses of each response's tokens per step (the z-lab protocol); tau_pooled = all
    committed tokens / all steps. Both come from Engine.generate's GenerationStats.
    """
    if not prompts:
        raise ValueError("no held-out prompts to measure tau on")
    context = max(len(p) for p in prompts) + max_tokens + 1
    engine = Engine.load(target_dir, drafter_dir, device=device, context_size=context)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    per_prompt, steps, committed, drafted, accepted = [], 0, 0, 0, 0
    for ids in tqdm(prompts, desc="held-out tau", unit="prompt", disable=not progress):
        s = engine.generate(ids, params).stats
        if s.steps == 0:  # finished at the first token: nothing was drafted
            continue
        per_prompt.append(s.tau)
        steps += s.steps
        committed += s.steps + s.draft_n_accepted
        drafted, accepted = drafted + s.draft_n, accepted + s.draft_n_accepted
    if not per_prompt:
        raise ValueError("every held-out generation stopped at its first token; tau is undefined")
    return {"tau": sum(per_prompt) / len(per_prompt), "tau_pooled": committed / steps,
            "acceptance_rate": accepted / drafted if drafted else 0.0, "prompts": len(per_prompt),
            "steps": steps, "max_tokens": max_tokens, "per_prompt_tau": per_prompt}
