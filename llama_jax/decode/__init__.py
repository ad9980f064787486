"""Sampling from a model: the token samplers (`sampling.py`: greedy, temperature, top-k, top-p,
min-p), the step every decoder takes (`step.py`), which decoder runs and whether it fits
(`decoder.py`), `generate` / `stream`, jit-compiled decoding whose KV cache is a functional
carry (`generate.py`), speculative decoding (`speculate.py`, its acceptance rule in
`acceptance.py`), and the device programs of continuous batching's decode slots (`slots.py`)
and of the prefix cache's pool (`prefix_pool.py`)."""
