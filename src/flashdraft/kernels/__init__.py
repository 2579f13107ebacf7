"""Every Triton kernel (the layers', the GGUF matmuls', the sampling's) and their plumbing (runtime.py); a kernel
module is imported on first use, so importing flashdraft never needs Triton."""
