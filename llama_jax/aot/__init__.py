"""Ahead of time: the library's programs compiled for hardware this host does not have (TPU
slices, GPU nodes: `parallel/topology.py`) and what the compiler says of them per device,
beside the planner's figures. `training.py`: the training step and evaluation of a run
(`train.py --compile-only --topology NAME`); `decoding.py`: a model's prefill and decode step
on one chip (`python -m llama_jax.aot.decoding MODEL --topology NAME`); `serving.py`: a
server's largest programs and whether they fit each device (`python -m llama_jax.serve
--compile-only --topology NAME`)."""
