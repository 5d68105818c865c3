"""Native CPU kernels (C, built on first use) for what PyTorch's ops cannot do in one pass."""
