"""Serving over the OpenAI API (`python -m llama_jax.serve`): continuous batching over decode
rows (`engine.py`; its device programs are `decode/batching.py`), the HTTP API (`api.py`, its
request bodies in `protocol.py`), stop-string aware text (`text.py`), the prefix cache's host
index (`prefix_index.py`), `/metrics` (`metrics.py`), building a server from a checkpoint
(`app.py`) and the flags that shape it (`flags.py`).
Needs the `serve` extra (fastapi, uvicorn, jinja2)."""
