"""The GPU dequantization of a prefill pass on Q4_K blocks in 256-row chunks (quant.q4k_columns): its bits against
the rows put back and the CPU reference, and its time against GGUF's order and against the copy back that it
replaces, on Gemma-4-31B's gate|up (43008 x 5376). Usage: PYTHONPATH=src:tests python
scripts/gpu/q4k_columns_dequant.py"""
import torch

from flashdraft.kernels import gguf_triton as tk
from flashdraft.quant import dequantize, q4k_columns
from test_gguf_quant import random_blocks

CHUNK = q4k_columns.CHUNK_ROWS


def time_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def main() -> None:
    rows = torch.from_numpy(random_blocks("Q4_K", rows=4 * CHUNK, blocks_per_row=21, seed=0)).cuda()
    chunked = tk.dequantize(q4k_columns.from_rows(rows), "Q4_K", 5376, torch.bfloat16, chunk_rows=CHUNK)
    print("chunks: the same bits as the rows:", torch.equal(chunked, tk.dequantize(rows, "Q4_K", 5376, torch.bfloat16)))
    print("rows: the CPU reference's fp32 bits:",
          torch.equal(tk.dequantize(rows, "Q4_K", 5376, torch.float32), dequantize(rows.cpu(), "Q4_K").cuda()))
    big = torch.randint(0, 256, (43008, 21 * 144), dtype=torch.uint8, device="cuda")  # timing only
    big_chunks = q4k_columns.from_rows(big)
    for name, fn in (("GGUF order", lambda: tk.dequantize(big, "Q4_K", 5376, torch.bfloat16)),
                     ("256-row chunks",
                      lambda: tk.dequantize(big_chunks, "Q4_K", 5376, torch.bfloat16, chunk_rows=CHUNK)),
                     ("chunks copied back, then GGUF order",
                      lambda: tk.dequantize(q4k_columns.to_rows(big_chunks), "Q4_K", 5376, torch.bfloat16))):
        print(f"dequantize 43008x5376 Q4_K to bf16, {name}: {time_us(fn):.1f} us")


if __name__ == "__main__":
    main()
