"""Planning before running: parameter counts, FLOPs and bytes (`costs.py`), the memory planner
(`memory.py`), accelerator peaks and measured rates (`hardware.py`), and the CLI that prints them
for a config (`python -m llama_jax.plan.info`)."""
