"""Gumbel-max in one kernel: the noise of engine.speculative.gumbel_noise (the same hash of seed, position and token
id, the same float32 steps) added to the warped log-probabilities and reduced to each block's best, instead of
some sixty small elementwise kernels over the row. On the H200 it picks the tokens the torch ops pick
(docs/performance.md, "Sampling on the candidates; plain steps with a drafter loaded").

Imported on first use by engine.speculative, so importing flashdraft never needs Triton.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

from flashdraft.kernels.split_reduce_triton import add, maximum, minimum


@triton.jit
def _mix32(x):
    """engine.speculative._mix32 on uint32 (its int64 arithmetic masked to 32 bits is uint32 arithmetic)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def gumbel_max_kernel(x_ptr, ids_ptr, pos_ptr, key_ptr, best_x_ptr, best_id_ptr, C, stride_x, stride_ids,
                      HAS_IDS: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program (block b, row t): over columns b*BLOCK.. of row t, the largest x + noise(token) and its token id
    (ids[t, c], or c without ids); the first on a tie, as torch.argmax. LIBDEVICE: libdevice's log (on a GPU;
    Triton's own is an approximation), else tl.log (the interpreter's, numpy's)."""
    b, t = tl.program_id(0), tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    ok = cols < C
    x = tl.load(x_ptr + t.to(tl.int64) * stride_x + cols, mask=ok, other=float("-inf"))
    if HAS_IDS:
        tokens = tl.load(ids_ptr + t.to(tl.int64) * stride_ids + cols, mask=ok, other=0)
    else:
        tokens = cols.to(tl.int64)
    k1 = tl.load(key_ptr).to(tl.uint32)
    k2 = tl.load(key_ptr + 1).to(tl.uint32)
    pos = tl.load(pos_ptr + t).to(tl.uint32)
    pos_key = _mix32((pos * 0x9E3779B1) ^ k1)
    h = _mix32(_mix32(tokens.to(tl.uint32) ^ k2) ^ pos_key)
    h = _mix32(h ^ (pos_key * 0x27D4EB2F))
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    u = tl.minimum(u, 1.0 - 1.0 / 16777216.0)
    if LIBDEVICE:
        y = x - libdevice.log(-libdevice.log(u))
    else:
        y = x - tl.log(-tl.log(u))
    top = tl.reduce(y, 0, maximum)
    first = tl.reduce(tl.where(y == top, tl.arange(0, BLOCK), BLOCK), 0, minimum)
    out = t.to(tl.int64) * tl.num_programs(0) + b
    tl.store(best_x_ptr + out, top)
    tl.store(best_id_ptr + out, tl.reduce(tl.where(tl.arange(0, BLOCK) == first, tokens, 0), 0, add))
