"""Benchmarks (GPU): kernel-level decode step vs the best dense kernels, clustering vs
dense prefill, and end-to-end decode of a Llama-3.1-8B-shaped model. See `kvsieve bench`."""
