"""The decode attention kernel's adopted tilings, compiled offline for the H100/H200 (sm_90) as the GPU compiles them
(scripts/kernel_sass.py), keep the registers a thread and the shared memory that let two of their programs share a
multiprocessor, in a sequence's launch and in a batched pass's (segmented).

The register count is where a harmless-looking source change slows the kernel: an index computed before the key
loop instead of after it took the 8-warp long-range tiling from 107 to 142 registers a thread, one program a
multiprocessor instead of two, the form that measured 190.9 us against 126.1 for a 16-token block over 32K keys;
the whole-block tile with three stages of keys (116 KiB of shared memory) held one program and measured 112.7 us
against 85.2 with two stages (docs/performance.md). The GPU is not needed: Triton's NVIDIA backend ships ptxas and
cuobjdump.
"""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from flashdraft.layers import decode_attention as da

ROOT = Path(__file__).resolve().parent.parent
REGISTERS_PER_MULTIPROCESSOR = 65536
SHARED_PER_MULTIPROCESSOR = 233472  # sm_90: 228 KiB, of which each program's share also holds 1 KiB reserved


def _nvidia_tools() -> bool:
    try:
        import triton
    except ImportError:
        return False
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (tools / "ptxas").exists() and (tools / "cuobjdump").exists()


@pytest.mark.skipif(not _nvidia_tools(), reason="Triton's NVIDIA backend (ptxas, cuobjdump) is not installed")
def test_attention_tilings_fit_two_programs_a_multiprocessor():
    # a fresh process: this session's tests may have switched Triton's interpreter on, which compiles nothing
    code = ("import json, sys; sys.path.insert(0, 'scripts'); import kernel_sass; "
            "print(json.dumps({**kernel_sass.attention_fingerprints(segmented=False), "
            "**kernel_sass.attention_fingerprints(segmented=True)}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(env, PYTHONPATH=str(ROOT / "src")))
    assert run.returncode == 0, run.stderr[-2000:]
    prints = json.loads(run.stdout.strip().splitlines()[-1])
    long = [c for _, c in da.LONG_CONFIGS]
    # one sequence's launch (the long tilings by tensor descriptors too), a batched pass's
    for config, form in [(c, f) for c in [da.CONFIG] + long for f in ("", " segmented")] + [
            (replace(c, tma=True), "") for c in long]:
        found = prints[f"attention d128 {config.name}{form}"]
        per_thread = -(-found["registers"] // 8) * 8  # allocated 8 registers a thread at a time
        programs = REGISTERS_PER_MULTIPROCESSOR // (per_thread * 32 * config.num_warps)
        assert programs >= 2, (config.name, form, found)
        assert SHARED_PER_MULTIPROCESSOR // (found["shared"] + 1024) >= 2, (config.name, form, found)
        assert found["stack"] == 0, (config.name, form, found)
    # Gemma 4's sliding layers (256 wide): one step a program, no spill (two steps on 4 warps spilled 64-72 bytes
    # and paid ~3.4 us a call before their keys)
    for form in ("", " segmented"):
        found = prints[f"attention d256 {da.WIDE_HEAD_CONFIG.name}{form}"]
        assert found["stack"] == 0 and found["registers"] <= 128, (form, found)
