"""Llama-family model runner: config, weights, forward over the paged cache, loaders."""
