"""MoE training throughput (CPU): the MoE demo against the dense demo at equal active
parameters, under both dispatch implementations; and a Mixtral-shaped model's train step
against transformers' MixtralForCausalLM.

    python bench/moe.py [--rounds 3] [--steps 4] [--threads 2]

1. Demo models (configs/demo.yaml, configs/moe-demo.yaml: D=256, L=6, V=8192; dense SwiGLU
   F=768 vs 8 SwiGLU experts of 384, top-2 — the same active parameters), the demo's batch
   (16 x 256), our jitted train step (AdamW, clipping): dense; MoE dropless (sorted tokens,
   `jax.lax.ragged_dot`); MoE with capacity factor 1.25 (index-scattered [E, C, D] buffers).
2. Mixtral-shaped: D=256, L=4, N=4, K=2, 8 experts of 384, top-2, V=8192, batch 8 x 256,
   dropless on our side (the function transformers computes; also as capacity buffers of C = T
   slots, the same function with E/top_k times the expert FLOPs), with the load-balancing loss on
   both sides (transformers: `output_router_logits=True`); transformers' step is forward,
   backward, `clip_grad_norm_`, AdamW. tokens/s = batch·seq / median step time (3 untimed
   steps first, compile excluded).
Each measurement runs in its own process, alternating, `--rounds` times; medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics

import jax
import numpy as np

from common import lm_train_step, run_child, time_torch_train_steps, time_train_steps
from llama_jax import load_run_config
from llama_jax.config import ModelConfig, MoeConfig, TrainConfig
from llama_jax.training.optim import make_optimizer
from llama_jax.training.step import init_state

WARMUP_STEPS = 3
DEMO, MOE_DEMO = load_run_config("demo"), load_run_config("configs/moe-demo.yaml")
MIXTRAL = ModelConfig(vocab_size=8192, dim=256, n_layers=4, n_heads=4, n_kv_heads=2,
                      ffn_dim=384, max_seq_len=512, mlp="moe",
                      moe=MoeConfig(n_experts=8, top_k=2, aux_loss_weight=0.01))
MODELS = {
    "dense demo": (DEMO.model, DEMO.train),
    "MoE demo, dropless": (dataclasses.replace(MOE_DEMO.model, moe=dataclasses.replace(
        MOE_DEMO.model.moe, capacity_factor=None)), MOE_DEMO.train),
    "MoE demo, capacity 1.25": (MOE_DEMO.model, MOE_DEMO.train),
    "Mixtral-shaped": (MIXTRAL, TrainConfig(seq_len=256, batch_size=8, warmup_steps=100)),
    # The same function on capacity buffers of C = T slots (nothing dropped): E/top_k times
    # the expert FLOPs, as batched matmuls instead of grouped ones.
    "Mixtral-shaped, capacity C=T": (MIXTRAL.with_execution(moe_dispatch="capacity"),
                                     TrainConfig(seq_len=256, batch_size=8, warmup_steps=100)),
}


def random_batch(config: ModelConfig, train: TrainConfig) -> np.ndarray:
    window = np.random.default_rng(0).integers(3, config.vocab_size,
                                               (train.batch_size, train.seq_len + 1))
    window[:, 0] = 1
    return window.astype(np.int32)


def run_ours(name: str, steps: int) -> dict:
    config, train = MODELS[name]
    optimizer = make_optimizer(config, train)
    state = jax.jit(functools.partial(init_state, config, optimizer))(jax.random.key(0))
    step = lm_train_step(config, train, optimizer)
    batch = jax.numpy.asarray(random_batch(config, train))
    compiled = step.lower(state, batch).compile()
    return {"step_s": time_train_steps(compiled, state, batch, WARMUP_STEPS, steps)}


def run_transformers(steps: int, threads: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    c, train = MODELS["Mixtral-shaped"]
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=c.V, hidden_size=c.D, intermediate_size=c.F, num_hidden_layers=c.L,
        num_attention_heads=c.N, num_key_value_heads=c.K, num_local_experts=c.moe.n_experts,
        num_experts_per_tok=c.moe.top_k, max_position_embeddings=c.max_seq_len,
        output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False))
    ids = torch.as_tensor(random_batch(c, train)[:, :train.seq_len], dtype=torch.long)
    return {"step_s": time_torch_train_steps(model, ids, WARMUP_STEPS, steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        name, steps = args.worker
        result = (run_transformers(int(steps), args.threads) if name == "transformers"
                  else run_ours(name, int(steps)))
        print(json.dumps(result))
        return

    kinds = [*MODELS, "transformers"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            times[kind] += run_child(__file__, "--worker", kind, str(args.steps), "--threads",
                                     str(args.threads))["step_s"]
    median = {k: statistics.median(v) for k, v in times.items()}

    def tokens_per_s(kind: str) -> float:
        train = MODELS["Mixtral-shaped" if kind == "transformers" else kind][1]
        return train.batch_size * train.seq_len / median[kind]

    print(f"median of {args.rounds} rounds x {args.steps} steps, each in its own process")
    print("| model | tokens/s | step ms | vs dense demo |")
    print("|---|---|---|---|")
    for kind in ("dense demo", "MoE demo, dropless", "MoE demo, capacity 1.25"):
        print(f"| {kind} | {tokens_per_s(kind):.0f} | {median[kind] * 1e3:.0f} | "
              f"{tokens_per_s(kind) / tokens_per_s('dense demo'):.2f}x |")
    print("\n| Mixtral-shaped step | tokens/s | step ms | vs transformers |")
    print("|---|---|---|---|")
    for kind, label in (("Mixtral-shaped", "ours, dropless (ragged_dot)"),
                        ("Mixtral-shaped, capacity C=T", "ours, capacity buffers of C = T"),
                        ("transformers", "transformers MixtralForCausalLM")):
        print(f"| {label} | {tokens_per_s(kind):.0f} | {median[kind] * 1e3:.0f} | "
              f"{tokens_per_s(kind) / tokens_per_s('transformers'):.2f}x |")


if __name__ == "__main__":
    main()
