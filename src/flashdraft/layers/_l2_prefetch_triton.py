"""The Triton kernel behind flashdraft.layers.l2_prefetch (imported on first use, so that importing flashdraft
never needs Triton and a CPU test can still set TRITON_INTERPRET first).

Each program reads STEPS consecutive blocks of BLOCK int32 words of the weight with `.cg` loads (cached in L2,
not in L1, which a later kernel on another SM could not use) and stores the xor of everything it read into its
slot of a small sink, so the compiler keeps the loads. The sink's value means nothing to the model; the tests use
it to check that every word was read.
"""
import triton
import triton.language as tl


# A combine function of our own rather than tl.xor_sum (a triton.language jit helper: see _skinny_triton on why
# kernels here use only builtins under the interpreter).
@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def l2_prefetch_kernel(words_ptr, sink_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * STEPS * BLOCK
    seen = tl.full((BLOCK,), 0, tl.int32)
    for step in range(STEPS):
        offsets = first + step * BLOCK + tl.arange(0, BLOCK)
        seen ^= tl.load(words_ptr + offsets, mask=offsets < n_words, other=0, cache_modifier=".cg")
    tl.store(sink_ptr + pid, tl.reduce(seen, 0, _xor))
