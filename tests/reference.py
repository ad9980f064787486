"""Float64 numpy references, written from the papers and Meta's `model.py`, independent of
llama_jax's code paths: Meta's interleaved complex RoPE, attention with explicitly repeated K/V,
per-row loops."""

from __future__ import annotations

import numpy as np


def relative_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def rms_norm(x, g, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(g, np.float64)


def silu(x):
    return x / (1 + np.exp(-x))


def swiglu(x, w_gate, w_up, w_down):
    return (silu(x @ w_gate) * (x @ w_up)) @ w_down


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


def forward(config, params, tokens_BT, positions_BT=None, segments_BT=None):
    """The whole model in float64, RoPE in Meta's interleaved layout on permuted q/k."""
    p = {k: np.asarray(v, np.float64) for k, v in _flat(params).items()}
    tokens = np.asarray(tokens_BT)
    B, T = tokens.shape
    positions = np.broadcast_to(np.arange(T), (B, T)) if positions_BT is None else positions_BT
    mask = causal_mask(T, segments_BT, B)
    inv_freq = meta_inv_freq(config)
    x = p["embed"][tokens]
    for i in range(config.n_layers):
        h = rms_norm(x, p["attn_norm"][i], config.norm_eps)
        q = to_interleaved(np.einsum("btd,dnh->btnh", h, p["wq"][i]))
        k = to_interleaved(np.einsum("btd,dkh->btkh", h, p["wk"][i]))
        v = np.einsum("btd,dkh->btkh", h, p["wv"][i])
        q, k = rope_meta(q, positions, inv_freq), rope_meta(k, positions, inv_freq)
        x = x + np.einsum("btnh,nhd->btd", attention(q, k, v, mask), p["wo"][i])
        h = rms_norm(x, p["ffn_norm"][i], config.norm_eps)
        x = x + swiglu(h, p["w_gate"][i], p["w_up"][i], p["w_down"][i])
    x = rms_norm(x, p["final_norm"], config.norm_eps)
    head = p["embed"].T if config.tie_embeddings else p["lm_head"]
    return x @ head


def _flat(params):
    block = params["groups"][0]
    out = {"attn_norm": block["attn_norm"]["scale"], "ffn_norm": block["mlp_norm"]["scale"],
           **block["attn"], **block["mlp"], "embed": params["embed"]["table"],
           "final_norm": params["final_norm"]["scale"]}
    if "lm_head" in params:
        out["lm_head"] = params["lm_head"]["w"]
    return out
