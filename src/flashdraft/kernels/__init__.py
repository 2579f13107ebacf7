"""GPU kernels shared across layers and quantized matmuls (Triton), imported on first use."""
