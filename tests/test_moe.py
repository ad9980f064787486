"""MoE pieces (nn/moe.py) against float64 references: routing, capacity slots and drops, the
two dispatch implementations, and the router losses."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.nn import moe
from reference import assert_close, relative_error, route as reference_route

X, E, D, F = 24, 8, 16, 12


def logits(rng, scale=3.0):
    """Decisive routers: near-uniform logits would flip top-k choices on rounding noise. Each
    test draws from its own seeded generator: its inputs never depend on which tests ran
    before it."""
    return (scale * rng.standard_normal((X, E))).astype(np.float32)


@pytest.mark.parametrize("router, normalize, scaling, groups, bias", [
    ("softmax", True, 1.0, (1, 1), False),    # Mixtral
    ("softmax", False, 1.0, (1, 1), False),   # Switch / GShard weights
    ("softmax", False, 1.0, (4, 2), False),   # DeepSeek-V2's group-limited routing
    ("sigmoid", True, 2.5, (4, 2), True),     # DeepSeek-V3: sigmoid, bias, groups, scaling
])
def test_routing_matches_the_float64_reference(router, normalize, scaling, groups, bias):
    rng = np.random.default_rng(1)
    z = logits(rng)
    bias_E = (0.3 * rng.standard_normal(E)).astype(np.float32) if bias else None
    routing = moe.route(z, top_k=2, router=router, normalize_top_k=normalize,
                        routed_scaling=scaling, n_groups=groups[0], top_k_groups=groups[1],
                        selection_bias_E=bias_E)
    experts, weights, scores = reference_route(z, 2, router, normalize, scaling, *groups, bias_E)
    np.testing.assert_array_equal(routing.experts_XR, experts)
    assert relative_error(routing.weights_XR, weights) < 1e-6
    assert relative_error(routing.scores_XE, scores) < 1e-6
    if bias:  # the bias moves choices, never weights: they are the unbiased scores
        np.testing.assert_allclose(routing.weights_XR / scaling,
                                   np.take_along_axis(scores, experts, 1)
                                   / np.take_along_axis(scores, experts, 1).sum(-1,
                                                                                keepdims=True),
                                   rtol=1e-5)


def reference_drops(experts_XR, slots):
    """A plain loop over (choice, token) in priority order."""
    load, dropped = np.zeros(E, int), 0
    for r in range(experts_XR.shape[1]):
        for x in range(experts_XR.shape[0]):
            e = experts_XR[x, r]
            if load[e] < slots:
                load[e] += 1
            else:
                dropped += 1
    return load, dropped


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25])
def test_capacity_slots_never_overflow_and_drops_match_a_loop(capacity_factor):
    routing = moe.route(logits(np.random.default_rng(2)), top_k=2)
    slots = moe.capacity(X * 2, E, capacity_factor)
    slot_XR, kept_XR = map(np.asarray, moe.capacity_slots(routing.experts_XR, E, slots))
    load, expected_dropped = reference_drops(np.asarray(routing.experts_XR), slots)
    assert expected_dropped == (~kept_XR).sum()
    kept_slots = slot_XR[kept_XR]
    assert len(np.unique(kept_slots)) == len(kept_slots)  # one assignment per slot
    np.testing.assert_array_equal(np.bincount(kept_slots // slots, minlength=E), load)
    assert (load <= slots).all()
    np.testing.assert_array_equal(kept_slots // slots, np.asarray(routing.experts_XR)[kept_XR])
    assert (slot_XR[~kept_XR] == E * slots).all()


def expert_params(mlp, seed=0):
    r = np.random.default_rng(seed)
    p = {"w_up": r.standard_normal((E, D, F)) / np.sqrt(D),
         "w_down": r.standard_normal((E, F, D)) / np.sqrt(F)}
    if mlp in ("swiglu", "geglu"):
        p["w_gate"] = r.standard_normal((E, D, F)) / np.sqrt(D)
    return {k: v.astype(np.float32) for k, v in p.items()}


def run_experts(p, x_XD, routing, rows=2, **kw):
    """`apply_experts` on the X tokens as `rows` sequences (its dispatch groups), `[X, D]`."""
    def split(a):
        return jnp.reshape(a, (rows, X // rows, *a.shape[1:]))
    y_BTD, dropped = moe.apply_experts(p, split(x_XD), split(routing.experts_XR),
                                       split(routing.weights_XR), **kw)
    return y_BTD.reshape(X, -1), dropped


def reference_experts(p, x_XD, experts_XR, weights_XR, mlp):
    act = {"swiglu": lambda h: h / (1 + np.exp(-h)), "relu": lambda h: np.maximum(h, 0)}[mlp]
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    out = np.zeros((len(x_XD), D))
    for x in range(len(x_XD)):
        for e, w in zip(experts_XR[x], weights_XR[x]):
            h = x_XD[x] @ p["w_up"][e]
            h = act(x_XD[x] @ p["w_gate"][e]) * h if "w_gate" in p else act(h)
            out[x] += w * (h @ p["w_down"][e])
    return out


@pytest.mark.parametrize("dispatch", moe.DISPATCHES)
@pytest.mark.parametrize("mlp", ["swiglu", "relu"])
def test_experts_match_the_float64_reference(dispatch, mlp):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((X, D)).astype(np.float32)
    routing = moe.route(logits(rng), top_k=2)
    y, dropped = run_experts(expert_params(mlp), x, routing, mlp=mlp, dispatch=dispatch)
    expected = reference_experts(expert_params(mlp), np.asarray(x, np.float64),
                                 np.asarray(routing.experts_XR), np.asarray(routing.weights_XR),
                                 mlp)
    assert int(dropped) == 0
    assert relative_error(y, expected) < 1e-5


@pytest.mark.parametrize("capacity_factor", [None, 8.0, 1.0, 0.5])
def test_capacity_equals_dropless_in_values_and_gradients(capacity_factor):
    """The two dispatches compute one function: with no drops (None, or room for every
    assignment) and with the same assignments dropped. Outputs and gradients are compared
    element by element on their scale (a scalar sum of them would cancel and amplify float32
    rounding; the two dispatches sum in different orders)."""
    r = np.random.default_rng(11)
    x = r.standard_normal((X, D)).astype(np.float32)
    cotangent = r.standard_normal((X, D)).astype(np.float32)
    z, p = logits(r), expert_params("swiglu")

    def experts(p, x, z, dispatch):
        routing = moe.route(z, top_k=2)
        return run_experts(p, x, routing, mlp="swiglu", dispatch=dispatch,
                           capacity_factor=capacity_factor)
    out = {}
    for dispatch in moe.DISPATCHES:
        (y, dropped), pullback = jax.vjp(lambda *a: experts(*a, dispatch), p, x, z)
        out[dispatch] = y, dropped, pullback((cotangent, np.zeros((), dropped.dtype)))
    (y_c, dropped_c, grads_c), (y_d, dropped_d, grads_d) = out["capacity"], out["dropless"]
    assert int(dropped_c) == int(dropped_d) and (int(dropped_c) > 0) == (
        capacity_factor in (1.0, 0.5))
    assert_close(y_c, y_d, 1e-5)
    chex.assert_trees_all_equal_structs(grads_c, grads_d)
    for (path, g_c), g_d in zip(jax.tree.leaves_with_path(grads_c), jax.tree.leaves(grads_d)):
        assert_close(g_c, g_d, 1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("dispatch", moe.DISPATCHES)
def test_a_token_whose_assignments_are_all_dropped_gets_nothing(dispatch):
    """(The block adds the MoE output to the residual: such a token passes through.)"""
    z = np.full((X, E), -5.0, np.float32)
    z[:, 0], z[:, 1] = 5.0, 4.0  # every token wants experts 0 and 1
    routing = moe.route(z, top_k=2)
    x = np.random.default_rng(4).standard_normal((X, D)).astype(np.float32)
    y, dropped = run_experts(expert_params("swiglu"), x, routing, rows=1, mlp="swiglu",
                             dispatch=dispatch, capacity_factor=1.0)
    slots = moe.capacity(X * 2, E, 1.0)  # 6 slots: tokens 0..5 keep both experts
    assert int(dropped) == 2 * (X - slots)
    assert np.all(np.asarray(y)[slots:] == 0) and np.all(np.abs(np.asarray(y)[:slots]) > 0)


@pytest.mark.parametrize("dispatch", moe.DISPATCHES)
def test_each_sequence_is_its_own_dispatch_group(dispatch):
    """Capacity is per sequence: a batch of rows drops (and computes) exactly what each row
    drops alone — rows never compete for slots."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((X, D)).astype(np.float32)
    routing = moe.route(logits(rng), top_k=2)
    p = expert_params("swiglu")
    kw = dict(mlp="swiglu", dispatch=dispatch, capacity_factor=0.75)
    together, dropped = run_experts(p, x, routing, rows=3, **kw)
    rows = [slice(8 * i, 8 * i + 8) for i in range(3)]
    alone = [moe.apply_experts(p, x[None, r], routing.experts_XR[None, r],
                               routing.weights_XR[None, r], **kw) for r in rows]
    assert_close(together, np.concatenate([y[0] for y, _ in alone]), 1e-5)
    assert int(dropped) == sum(int(d) for _, d in alone) > 0


def test_load_balancing_loss_is_its_formula():
    uniform = moe.Routing(jnp.asarray(np.arange(X * 2).reshape(X, 2) % E, jnp.int32),
                          jnp.full((X, 2), 0.5), jnp.full((X, E), 1 / E))
    assert float(moe.load_balancing_loss(uniform)) == pytest.approx(1.0)
    rng = np.random.default_rng(7)
    routing = moe.route(logits(rng), top_k=2)
    f = np.bincount(np.asarray(routing.experts_XR).ravel(), minlength=E) / (X * 2)
    expected = E * np.sum(f * np.asarray(routing.scores_XE, np.float64).mean(0))
    # (sums of positive terms: float32 against float64, a few roundings of each term)
    assert float(moe.load_balancing_loss(routing)) == pytest.approx(expected, rel=1e-5)
    z = logits(rng)
    lse = np.log(np.exp(np.asarray(z, np.float64)).sum(-1))
    assert float(moe.router_z_loss(z)) == pytest.approx(np.mean(lse ** 2), rel=1e-5)


# ------------------------------------------------------------------ in a model and a train step

def _moe_model(n_layers=2, **moe_fields):
    from llama_jax.config import ModelConfig, MoeConfig

    return ModelConfig(vocab_size=128, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                       ffn_dim=32, max_seq_len=64, mlp="moe", moe=MoeConfig(**moe_fields))


def _one_step(config, seed=0):
    import functools

    from llama_jax.config import TrainConfig
    from llama_jax.training.optim import make_optimizer
    from llama_jax.config import RunConfig
    from llama_jax.training.step import init_state, objective, train_step

    train = TrainConfig(seq_len=16, batch_size=4, learning_rate=1e-2, warmup_steps=0)
    optimizer = make_optimizer(config, train)
    state = init_state(config, optimizer, jax.random.key(seed))
    loss_fn = objective(RunConfig(config, train), 1)
    step = jax.jit(functools.partial(train_step, config, train, optimizer, loss_fn))
    new_state, metrics = step(state, _window(seed))
    return state, new_state, metrics


def _window(seed):
    window = np.random.default_rng(seed).integers(3, 128, (4, 17)).astype(np.int32)
    window[:, 0] = 1
    return window


def test_the_selection_bias_moves_towards_balance_outside_the_gradient():
    """DeepSeek-V3: b_e += rate · sign(mean load − load_e) per layer after the step; AdamW
    (zero gradient, no decay) leaves it otherwise untouched."""
    from llama_jax.data.batches import features
    from llama_jax.model.transformer import apply

    config = _moe_model(3, n_experts=4, top_k=2, router="sigmoid", first_dense_layers=1,
                        bias_update_rate=0.01)
    state, new_state, metrics = _one_step(config)
    f = features(_window(0), 1)  # the step's loads, recomputed from the same batch
    out = apply(config, state.params, f.inputs_BT, positions_BT=f.positions_BT,
                segment_ids_BT=f.segment_ids_BT)
    load_LE = np.asarray(out.aux[1]["moe"]["load_E"])
    assert load_LE.shape == (2, 4) and (load_LE.sum(-1) == 4 * 16 * 2).all()
    expected = np.asarray(state.params["groups"][1]["mlp"]["selection_bias"]) + 0.01 * np.sign(
        load_LE.mean(-1, keepdims=True) - load_LE)
    np.testing.assert_allclose(new_state.params["groups"][1]["mlp"]["selection_bias"],
                               expected, atol=1e-7)
    assert (np.abs(expected) > 0).any()
    for name in ("moe_load_balancing_loss", "moe_router_z_loss", "moe_dropped_fraction",
                 "moe_max_load_share", "moe_min_load_share", "moe_router_entropy"):
        assert np.isfinite(float(metrics[name])), name


def test_the_aux_losses_enter_the_training_loss_with_their_weights():
    """loss_sums' total = CE sum + count · Σ_layers (aux_loss_weight · balance + z weight · z),
    with the per-layer losses those of the load statistics; a near-uniform router at init has
    a balance loss near 1, router entropy near ln E and drops nothing."""
    from llama_jax.model.transformer import aux_metrics
    from llama_jax.training.step import loss_sums

    config = _moe_model(n_experts=4, top_k=2, aux_loss_weight=0.5, router_z_loss_weight=0.25)
    params = llama_jax.init_params(config, jax.random.key(0))
    total, (sums, aux) = jax.jit(loss_sums, static_argnums=(0, 3, 4))(
        config, params, _window(0), 1, 0.0)
    ce_sum, count = sums["loss_sum"], sums["count"]
    stats = aux[0]["moe"]  # one MoE group, [L, ...]
    balance_L, z_L = stats["balance"] / stats["tokens"], stats["z"] / stats["tokens"]
    expected = float(ce_sum) + float(count) * float(jnp.sum(0.5 * balance_L + 0.25 * z_L))
    assert float(total) == pytest.approx(expected, rel=1e-6)
    assert float(jnp.sum(aux[0]["loss"])) == pytest.approx(
        float(jnp.sum(0.5 * balance_L + 0.25 * z_L)), rel=1e-6)
    metrics = aux_metrics(aux)
    assert float(metrics["moe_load_balancing_loss"]) == pytest.approx(1.0, abs=0.2)
    assert float(metrics["moe_router_entropy"]) == pytest.approx(np.log(4), abs=0.05)
    assert float(metrics["moe_dropped_fraction"]) == 0.0
