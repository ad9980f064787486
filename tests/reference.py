"""Float64 numpy references, written from the papers and Meta's `model.py`, independent of
llama_jax's code paths: Meta's interleaved complex RoPE, attention with explicitly repeated K/V,
per-row loops."""

from __future__ import annotations

import math

import numpy as np


def relative_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def rms_norm(x, g, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(g, np.float64)


def silu(x):
    return x / (1 + np.exp(-x))


def meta_inv_freq(config):
    """Meta's `precompute_freqs_cis` frequencies and `apply_scaling` loop, in float64."""
    H = config.head_dim
    freqs = 1.0 / config.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    s = config.rope_scaling
    if s is None:
        return freqs
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / s.factor)
        else:
            smooth = (old_context / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            new_freqs.append((1 - smooth) * freq / s.factor + smooth * freq)
    return np.array(new_freqs)


def to_interleaved(x):
    """Half-split head features (i, i+H/2) → Meta's adjacent pairs (2i, 2i+1), last axis."""
    *lead, H = x.shape
    return np.asarray(x).reshape(*lead, 2, H // 2).swapaxes(-1, -2).reshape(*lead, H)


def rope_meta(x_BTNH, positions_BT, inv_freq):
    """Meta's `apply_rotary_emb`: adjacent feature pairs as complex numbers times e^{i·m·θ}."""
    x = np.asarray(x_BTNH, np.float64)
    xc = x[..., 0::2] + 1j * x[..., 1::2]
    angles = np.asarray(positions_BT, np.float64)[..., None] * inv_freq  # [B, T, H/2]
    out = xc * np.exp(1j * angles)[:, :, None, :]
    return np.stack([out.real, out.imag], axis=-1).reshape(x.shape)


def attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS):
    """Per-row, per-head softmax attention with K/V repeated to N heads."""
    B, T, N, H = q_BTNH.shape
    G = N // k_BSKH.shape[2]
    k = np.repeat(np.asarray(k_BSKH, np.float64), G, axis=2)
    v = np.repeat(np.asarray(v_BSKH, np.float64), G, axis=2)
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for n in range(N):
            scores = q_BTNH[b, :, n] @ k[b, :, n].T / np.sqrt(H)
            scores = np.where(mask_BTS[b], scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, :, n] = (p / p.sum(-1, keepdims=True)) @ v[b, :, n]
    return out


def causal_mask(T, segments_BT=None, B=1):
    mask = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    if segments_BT is not None:
        seg = np.asarray(segments_BT)
        mask &= seg[:, :, None] == seg[:, None, :]
    return mask


def layer_norm(x, g, b, eps):
    """Ba et al. 2016: (x - mean) / sqrt(var + eps) · g + b."""
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.asarray(g, np.float64) + np.asarray(b, np.float64)


def gelu_erf(x):
    """Hendrycks & Gimpel 2016: x · Φ(x), Φ the standard normal CDF."""
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def gelu_tanh(x):
    """Their tanh approximation (GPT-2's gelu_new)."""
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


ACTIVATIONS = {"swiglu": silu, "geglu": gelu_erf, "gelu": gelu_erf, "gelu_tanh": gelu_tanh,
               "relu": lambda x: np.maximum(x, 0.0)}


def sinusoids(positions_BT, dim):
    """Vaswani et al. 2017: PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(...)."""
    pe = np.zeros((*np.shape(positions_BT), dim))
    p = np.asarray(positions_BT, np.float64)[..., None]
    i = np.arange(0, dim, 2)
    pe[..., 0::2] = np.sin(p / 10000.0 ** (i / dim))
    pe[..., 1::2] = np.cos(p / 10000.0 ** (i / dim))[..., :dim // 2]
    return pe


def forward(config, params, tokens_BT, positions_BT=None, segments_BT=None):
    """The whole model in float64 from the papers' formulas, for every component kind. RoPE
    is Meta's interleaved complex form on q/k whose features are permuted to that layout."""
    p = {k: np.asarray(v, np.float64) for k, v in params_flat(params).items()}
    tokens = np.asarray(tokens_BT)
    B, T = tokens.shape
    positions = np.broadcast_to(np.arange(T), (B, T)) if positions_BT is None else positions_BT
    mask = causal_mask(T, segments_BT, B)

    def norm(x, name, i=None):
        pick = (lambda a: a) if i is None else (lambda a: a[i])
        if config.norm == "layernorm":
            return layer_norm(x, pick(p[name + "/scale"]), pick(p[name + "/bias"]),
                              config.norm_eps)
        return rms_norm(x, pick(p[name + "/scale"]), config.norm_eps)

    def proj(x, equation, w, b, i):
        y = np.einsum(equation, x, p[w][i])
        return y + p[b][i] if b in p else y

    def rotate(x):
        if config.positions != "rope":
            return x
        return rope_meta(to_interleaved(x), positions, meta_inv_freq(config))

    x = p["embed/table"][tokens]
    if config.embed_scale:
        x = x * math.sqrt(config.dim)
    if config.positions == "sinusoidal":
        x = x + sinusoids(positions, config.dim)
    elif config.positions == "learned":
        x = x + p["positions/table"][positions]
    act = ACTIVATIONS[config.mlp]
    pre = config.norm_position == "pre"
    for i in range(config.n_layers):
        h = norm(x, "attn_norm", i) if pre else x
        q = rotate(proj(h, "btd,dnh->btnh", "attn/wq", "attn/bq", i))
        k = rotate(proj(h, "btd,dkh->btkh", "attn/wk", "attn/bk", i))
        v = proj(h, "btd,dkh->btkh", "attn/wv", "attn/bv", i)
        x = x + proj(attention(q, k, v, mask), "btnh,nhd->btd", "attn/wo", "attn/bo", i)
        if not pre:
            x = norm(x, "attn_norm", i)
        h = norm(x, "mlp_norm", i) if pre else x
        up = proj(h, "btd,df->btf", "mlp/w_up", "mlp/b_up", i)
        if config.mlp in ("swiglu", "geglu"):
            hidden = act(proj(h, "btd,df->btf", "mlp/w_gate", "mlp/b_gate", i)) * up
        else:
            hidden = act(up)
        x = x + proj(hidden, "btf,fd->btd", "mlp/w_down", "mlp/b_down", i)
        if not pre:
            x = norm(x, "mlp_norm", i)
    if pre:
        x = norm(x, "final_norm")
    head = p["embed/table"].T if config.tie_embeddings else p["lm_head/w"]
    return x @ head


def params_flat(params):
    """The parameter tree as {"attn/wq": [L, ...], "embed/table": ..., ...} (one layer group)."""
    out = {}
    for path, leaf in _paths(params):
        parts = path.split("/")
        out["/".join(parts[2:]) if parts[0] == "groups" else path] = leaf
    return out


def _paths(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, f"{prefix}{key}/")
    elif isinstance(tree, (tuple, list)):
        for i, value in enumerate(tree):
            yield from _paths(value, f"{prefix}{i}/")
    else:
        yield prefix[:-1], tree
