"""Serving over the OpenAI API (`python -m llama_jax.serve`): continuous batching over decode
rows (`engine.py`, over its requests (`requests.py`), the KV cache's pages (`pages.py`,
`prefix_index.py`, `allocator.py`), its device programs (`programs.py`, which compiles
`decode/batching.py`'s), the prompts being prefilled (`prefill.py`) and speculation's
auto-off (`verify_policy.py`)), the HTTP API (`api.py`, its request bodies in `protocol.py`),
stop-string aware text (`text.py`), `/metrics` (`metrics.py`), building a server from a
checkpoint (`app.py`) and the flags that shape it (`flags.py`).
Needs the `serve` extra (fastapi, uvicorn, jinja2)."""
