"""Sampling from a model: the token samplers (`sampling.py`: greedy, temperature, top-k, top-p,
min-p), which decoder runs and whether it fits (`decoder.py`), `generate` / `stream`,
jit-compiled decoding whose KV cache is a functional carry (`generate.py`), and the device
programs of continuous batching's decode slots (`slots.py`)."""
