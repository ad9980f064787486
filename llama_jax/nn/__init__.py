"""The model's components as pure functions: norms (`norms.py`), positions and RoPE
(`positions.py`, `rope.py`), dense MLPs (`mlp.py`), Mixture of Experts (`moe.py`), the attention
mixers and their kernels (`attention/`), and heads with their tasks' targets, losses and metrics
(`heads.py`), with the shared numerics in `ops.py`. Each component describes its tensors once
(`llama_jax.spec.TensorSpec`) and is chosen by a model config value."""
