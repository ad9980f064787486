"""Sampling from a model: the token samplers (`sampling.py`: greedy, temperature, top-k, top-p,
min-p), the model's step over each row's last token (`step.py`), the decode rows every decoder
carries and their step and speculative round (`rows.py`), which decoder runs and whether it
fits (`decoder.py`), `generate` / `stream`, jit-compiled decoding whose rows are a functional
carry (`generate.py`), speculative decoding (`speculate.py`, its acceptance rule in
`acceptance.py`), and the device programs of continuous batching over a paged KV cache
(`batching.py`)."""
