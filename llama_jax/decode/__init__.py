"""Sampling from a model: the token samplers (`sampling.py`: greedy, temperature, top-k, top-p,
min-p), `generate` / `stream`, jit-compiled decoding whose KV cache is a functional carry
(`generate.py`), and the device programs of continuous batching's decode slots (`slots.py`)."""
