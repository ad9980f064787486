"""MoE pieces (nn/moe.py) against float64 references: routing, capacity slots and drops, the
two dispatch implementations, and the router losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.nn import moe
from reference import relative_error, route as reference_route

rng = np.random.default_rng(5)
X, E, D, F = 24, 8, 16, 12


def logits(scale=3.0):
    """Decisive routers: near-uniform logits would flip top-k choices on rounding noise."""
    return (scale * rng.standard_normal((X, E))).astype(np.float32)


@pytest.mark.parametrize("router, normalize, scaling, groups, bias", [
    ("softmax", True, 1.0, (1, 1), False),    # Mixtral
    ("softmax", False, 1.0, (1, 1), False),   # Switch / GShard weights
    ("softmax", False, 1.0, (4, 2), False),   # DeepSeek-V2's group-limited routing
    ("sigmoid", True, 2.5, (4, 2), True),     # DeepSeek-V3: sigmoid, bias, groups, scaling
])
def test_routing_matches_the_float64_reference(router, normalize, scaling, groups, bias):
    z = logits()
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
    routing = moe.route(logits(), top_k=2)
    slots = moe.capacity(X * 2, E, capacity_factor)
    slot_XR, kept_XR, dropped = map(np.asarray, moe.capacity_slots(routing, E, slots))
    load, expected_dropped = reference_drops(np.asarray(routing.experts_XR), slots)
    assert int(dropped) == expected_dropped == (~kept_XR).sum()
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
    x = rng.standard_normal((X, D)).astype(np.float32)
    routing = moe.route(logits(), top_k=2)
    y, dropped = moe.apply_experts(expert_params(mlp), x, routing, mlp=mlp, dispatch=dispatch)
    expected = reference_experts(expert_params(mlp), np.asarray(x, np.float64),
                                 np.asarray(routing.experts_XR), np.asarray(routing.weights_XR),
                                 mlp)
    assert int(dropped) == 0
    assert relative_error(y, expected) < 1e-5


@pytest.mark.parametrize("capacity_factor", [None, 8.0, 1.0, 0.5])
def test_capacity_equals_dropless_in_values_and_gradients(capacity_factor):
    """The two dispatches compute one function: with no drops (None, or room for every
    assignment) and with the same assignments dropped."""
    x = rng.standard_normal((X, D)).astype(np.float32)
    z, p = logits(), expert_params("swiglu")

    def loss(p, x, z, dispatch):
        routing = moe.route(z, top_k=2)
        y, dropped = moe.apply_experts(p, x, routing, mlp="swiglu", dispatch=dispatch,
                                       capacity_factor=capacity_factor)
        return jnp.sum(y * jnp.cos(jnp.arange(D))), dropped
    out = {d: jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(p, x, z, d)
           for d in moe.DISPATCHES}
    (value_c, dropped_c), grads_c = out["capacity"]
    (value_d, dropped_d), grads_d = out["dropless"]
    assert int(dropped_c) == int(dropped_d) and (int(dropped_c) > 0) == (
        capacity_factor in (1.0, 0.5))
    assert relative_error(value_c, value_d) < 1e-6
    for g_c, g_d in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads_d)):
        assert relative_error(g_c, g_d) < 1e-5


@pytest.mark.parametrize("dispatch", moe.DISPATCHES)
def test_a_token_whose_assignments_are_all_dropped_gets_nothing(dispatch):
    """(The block adds the MoE output to the residual: such a token passes through.)"""
    z = np.full((X, E), -5.0, np.float32)
    z[:, 0], z[:, 1] = 5.0, 4.0  # every token wants experts 0 and 1
    routing = moe.route(z, top_k=2)
    x = rng.standard_normal((X, D)).astype(np.float32)
    y, dropped = moe.apply_experts(expert_params("swiglu"), x, routing, mlp="swiglu",
                                   dispatch=dispatch, capacity_factor=1.0)
    slots = moe.capacity(X * 2, E, 1.0)  # 6 slots: tokens 0..5 keep both experts
    assert int(dropped) == 2 * (X - slots)
    assert np.all(np.asarray(y)[slots:] == 0) and np.all(np.abs(np.asarray(y)[:slots]) > 0)


def test_load_balancing_loss_is_its_formula():
    uniform = moe.Routing(jnp.asarray(np.arange(X * 2).reshape(X, 2) % E, jnp.int32),
                          jnp.full((X, 2), 0.5), jnp.full((X, E), 1 / E))
    assert float(moe.load_balancing_loss(uniform)) == pytest.approx(1.0)
    routing = moe.route(logits(), top_k=2)
    f = np.bincount(np.asarray(routing.experts_XR).ravel(), minlength=E) / (X * 2)
    expected = E * np.sum(f * np.asarray(routing.scores_XE, np.float64).mean(0))
    assert float(moe.load_balancing_loss(routing)) == pytest.approx(expected, rel=1e-6)
    z = logits()
    lse = np.log(np.exp(np.asarray(z, np.float64)).sum(-1))
    assert float(moe.router_z_loss(z)) == pytest.approx(np.mean(lse ** 2), rel=1e-6)
