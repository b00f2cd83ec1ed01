"""Per-step kernels of the runner, each with a PyTorch reference of exactly the kernel's semantics."""
