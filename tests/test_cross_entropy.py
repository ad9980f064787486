"""The LM loss: the dense head's values and gradients against float64 references, in fp32 and
bf16, whole or a run of positions at a time (`nn.heads.LOSS_RUN`); the loss computed a piece of
positions at a time (`loss_chunk`): its values against a float64 reference, its gradients
against the dense loss's, and its compiled temporaries against the dense loss's at a large
vocabulary."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.config import ModelConfig
from llama_jax.errors import ConfigError
from llama_jax.model.params import init_params
from llama_jax.nn import heads
from llama_jax.training.cross_entropy import log_z_and_target
from llama_jax.training.step import loss_sums
from reference import assert_close, relative_error

MODEL = ModelConfig(vocab_size=384, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                    max_seq_len=64)
B, T = 3, 40


def _inputs(config):
    params = init_params(config, jax.random.key(0))
    h_BTD = jax.random.normal(jax.random.key(1), (B, T, config.dim))
    targets_BT = jax.random.randint(jax.random.key(2), (B, T), 0, config.vocab_size)
    return params, h_BTD, targets_BT


def _reference(params, h_BTD, targets_BT, tied):
    """float64 `(logits, log Z, target logit)` of the head."""
    w_DV = params["embed"]["table"].T if tied else params["lm_head"]["w"]
    logits = np.asarray(h_BTD, np.float64) @ np.asarray(w_DV, np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return logits, log_z, np.take_along_axis(logits, np.asarray(targets_BT)[..., None], -1)[..., 0]


# chunks that divide T, that leave a padded last piece, and that cover all of T; the dense
# head's forward runs that divide T (16: 2 of 20) and whose last overhangs (12: 3 of 14)
@pytest.mark.parametrize("chunk, tied, run", [
    (None, False, None), (None, False, 16), (None, True, 12), (8, False, None),
    (12, False, None), (64, False, None), (12, True, None)])
def test_log_z_and_target_logit_equal_a_float64_reference(chunk, tied, run,
                                                           monkeypatch):
    if run:
        monkeypatch.setattr(heads, "LOSS_RUN", run)
    config = dataclasses.replace(MODEL, loss_chunk=chunk, tie_embeddings=tied)
    params, h_BTD, targets_BT = _inputs(config)
    log_z_BT, target_BT = log_z_and_target(config, params, h_BTD, targets_BT)
    _, want_log_z, want_target = _reference(params, h_BTD, targets_BT, tied)
    assert_close(log_z_BT, want_log_z, 1e-6)
    assert_close(target_BT, want_target, 1e-6)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-6), ("bfloat16", 1e-2)])
@pytest.mark.parametrize("tied, run", [(False, None), (True, 12)])
def test_the_dense_heads_gradients_equal_a_float64_reference(dtype, tolerance, tied,
                                                              run, monkeypatch):
    """Its backward pass computes the softmax from the log-softmax kept in the compute dtype:
    in bf16 that costs what rounding the logits' gradient to bf16 costs (each entry off by at
    most 2^-9 of p·|log p| <= 2^-9/e), so the gradients stay within bf16's error of the
    float64 ones. The weights of the two terms are random, as the loss's z-loss makes them."""
    if run:
        monkeypatch.setattr(heads, "LOSS_RUN", run)
    config = dataclasses.replace(MODEL, tie_embeddings=tied, compute_dtype=dtype)
    params, h_BTD, targets_BT = _inputs(config)
    h_BTD = h_BTD.astype(dtype)
    a_BT, b_BT = jax.random.normal(jax.random.key(5), (2, B, T))

    def loss(params, h_BTD):
        log_z_BT, target_BT = log_z_and_target(config, params, h_BTD, targets_BT)
        return jnp.sum(a_BT * log_z_BT - b_BT * target_BT)

    grads, d_h = jax.grad(loss, argnums=(0, 1))(params, h_BTD)
    # float64: d logits = a·softmax - b·onehot, through the bf16-rounded operands
    rounded = jax.tree.map(lambda x: np.asarray(x.astype(dtype), np.float64), params)
    logits, log_z, _ = _reference(rounded, h_BTD, targets_BT, tied)
    d_logits = np.asarray(a_BT)[..., None] * np.exp(logits - log_z[..., None])
    np.put_along_axis(d_logits, np.asarray(targets_BT)[..., None], np.take_along_axis(
        d_logits, np.asarray(targets_BT)[..., None], -1) - np.asarray(b_BT)[..., None], -1)
    w_DV = rounded["embed"]["table"].T if tied else rounded["lm_head"]["w"]
    h = np.asarray(h_BTD, np.float64)
    want_d_w = np.einsum("btd,btv->dv", h, d_logits)
    got_d_w = grads["embed"]["table"].T if tied else grads["lm_head"]["w"]
    assert relative_error(d_h, np.einsum("btv,dv->btd", d_logits, w_DV)) < tolerance
    assert relative_error(got_d_w, want_d_w) < tolerance


WINDOW = np.array(jax.random.randint(jax.random.key(3), (B, T + 1), 2, MODEL.vocab_size))
WINDOW[:, [0, 17]] = 1  # two packed documents per row, the second unscored at its BOS


def _loss_and_grads(config, params):
    """The training loss (with z-loss) and its gradient for every parameter."""
    loss = jax.jit(jax.value_and_grad(loss_sums, argnums=1, has_aux=True),
                   static_argnums=(0, 3, 4))
    (total, _), grads = loss(config, params, WINDOW, 1, 1e-2)
    return total, grads


@pytest.mark.parametrize("chunk, tied", [(8, False), (12, False), (12, True)])
def test_the_chunked_loss_has_the_dense_loss_and_gradients(chunk, tied):
    dense = dataclasses.replace(MODEL, tie_embeddings=tied)
    params = init_params(dense, jax.random.key(4))
    want, want_grads = _loss_and_grads(dense, params)
    got, grads = _loss_and_grads(dataclasses.replace(dense, loss_chunk=chunk), params)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    wanted = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert relative_error(g, wanted[path]) < 1e-6, jax.tree_util.keystr(path)


def test_the_chunked_loss_never_holds_the_whole_batch_of_logits():
    """At V = 32K, the compiled loss-and-gradient of the dense loss holds two `[B, T, V]` fp32
    arrays (logits, then their softmax's gradient); the chunked one two `[B, C, V]` ones and
    the head's gradient accumulated over the pieces (measured: exactly these, plus 0.1%)."""
    big = dataclasses.replace(MODEL, vocab_size=32768)
    params, h_BTD, targets_BT = _inputs(big)

    def temporaries(config):
        def loss(params, h_BTD):
            log_z_BT, target_BT = log_z_and_target(config, params, h_BTD, targets_BT)
            return jnp.sum(log_z_BT - target_BT)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, h_BTD).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    chunk = 4
    dense, chunked = temporaries(big), temporaries(dataclasses.replace(big, loss_chunk=chunk))
    logits_bytes, piece_bytes = (B * n * big.vocab_size * 4 for n in (T, chunk))
    head_grad_bytes = big.dim * big.vocab_size * 4
    assert dense >= 2 * logits_bytes
    assert chunked < 2 * piece_bytes + head_grad_bytes + (64 << 10), (chunked, dense)


def test_loss_chunk_is_refused_for_a_task_head():
    with pytest.raises(ConfigError, match="loss_chunk=8 applies to the LM head's loss"):
        dataclasses.replace(MODEL, head="regression", n_labels=1, loss_chunk=8)
    with pytest.raises(ConfigError, match="loss_chunk"):
        dataclasses.replace(MODEL, loss_chunk=0)
