"""Downstream tasks' losses, as pure functions of (params, batch), and their batches' shapes,
both from the task of the head kind (`Task`, nn/heads.py: each kind's objective and metrics).
Losses are sums over the scored rows (or tokens) with their count, like the language-modelling
loss (step.py), so micro-batches and validation batches add up. Validation adds the
statistics the metrics need, also as sums: the confusion matrix for classification (accuracy
and macro-F1 follow from it, over any number of batches) and the squared error per target for
regression (RMSE).

With `train.freeze: backbone` the gradient stops at the final hidden states: only the head's
backward pass runs (the optimizer also leaves the backbone untouched, optim.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llama_jax.config import ModelConfig, RunConfig
from llama_jax.model.transformer import apply, aux_loss
from llama_jax.nn.heads import HEADS, apply_head, padding_layout
from llama_jax.model.params import Params


def abstract_batch(run: RunConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of a task's batch (data/tasks.py): the targets' as their kind
    describes them."""
    B, T = run.train.batch_size, run.train.seq_len
    task = HEADS[run.task.kind].task
    sizes = {"T": T, "O": run.model.n_labels}
    return {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32),
            "weight": jax.ShapeDtypeStruct((B,), jnp.float32),
            task.field: jax.ShapeDtypeStruct((B, *(sizes[a] for a in task.target)),
                                             task.dtype)}


def loss_sums(config: ModelConfig, frozen: bool, params: Params, batch: dict
              ) -> tuple[jax.Array, tuple[dict, tuple]]:
    """(the objective summed over scored rows or tokens, with the blocks' auxiliary losses
    scaled by their count), ({loss_sum, count, statistics...}, the blocks' auxiliary
    outputs)."""
    tokens_BT = batch["tokens"]
    positions_BT, segment_ids_BT = padding_layout(config, tokens_BT)
    out = apply(config, params, tokens_BT, positions_BT=positions_BT,
                segment_ids_BT=segment_ids_BT)
    h_BTD = jax.lax.stop_gradient(out.hidden_BTD) if frozen else out.hidden_BTD
    outputs = apply_head(config, params, h_BTD, tokens_BT)
    sums = HEADS[config.head].task.sums(config, outputs, batch)
    total = sums["loss_sum"] + (0.0 if frozen else aux_loss(out.aux) * sums["count"])
    return total, (sums, out.aux)

