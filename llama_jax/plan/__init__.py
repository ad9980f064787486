"""Planning before running: parameter counts, FLOPs and bytes (`costs.py`), the memory planner
(`memory.py`), accelerator peaks and measured rates (`hardware.py`), a server's shape and the
pages of its KV cache (`serving.py`), and the CLI that prints them for a config
(`python -m llama_jax.plan.info`)."""
