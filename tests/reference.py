"""Float64 numpy references, written from the papers and Meta's `model.py`, independent of
llama_jax's code paths: Meta's interleaved complex RoPE, attention with explicitly repeated K/V,
per-row loops."""

from __future__ import annotations

import math

import numpy as np


def relative_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def assert_close(out, ref, tol, err_msg=""):
    """Elementwise |out - ref| <= tol · (|ref| + max |ref|). Float32 rounding of a reduction is
    relative to the magnitudes of its terms, not to its result (cancellation makes that as
    small as it likes): an element's error is bounded on the array's scale as well as its own."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max(initial=0.0),
                               err_msg=err_msg)


def rms_norm(x, g, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(g, np.float64)


# Norm kinds by name: (x, {tensor name: value}, eps) -> normed x. A test may add one.
NORMS = {"rmsnorm": lambda x, p, eps: rms_norm(x, p["scale"], eps),
         "layernorm": lambda x, p, eps: layer_norm(x, p["scale"], p["bias"], eps)}


def silu(x):
    return x / (1 + np.exp(-x))


def meta_inv_freq(config):
    """Meta's `precompute_freqs_cis` frequencies and `apply_scaling` loop, in float64 (YaRN's
    by DeepSeek's `yarn_*` functions)."""
    H = config.rope_dim
    freqs = 1.0 / config.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    s = config.rope_scaling
    if s is None:
        return freqs
    if config.rope_type == "yarn":
        return yarn_inv_freq(freqs, s, config.rope_theta)
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


def yarn_inv_freq(freqs, s, base):
    """DeepSeek-V2's `DeepseekV2YarnRotaryEmbedding`: interpolated and extrapolated frequencies
    mixed by a linear ramp over the dimensions between the correction range's ends."""
    dim = 2 * len(freqs)

    def correction_dim(rotations):
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                ) / (2 * math.log(base))
    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    mask = 1 - ramp  # 1: extrapolate (keep θ)
    return freqs / s.factor * (1 - mask) + freqs * mask


def yarn_get_mscale(scale, mscale):
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def rope_and_softmax_scales(config):
    """(what cos/sin are multiplied by, the softmax scale), as transformers' DeepSeek models."""
    scale = config.head_dim ** -0.5
    s = config.rope_scaling
    if config.rope_type != "yarn":
        return 1.0, scale
    if s.mscale and s.mscale_all_dim:
        rope = yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim)
    else:
        rope = yarn_get_mscale(s.factor, 1.0)
    if s.mscale_all_dim:
        scale *= yarn_get_mscale(s.factor, s.mscale_all_dim) ** 2
    return rope, scale


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


def attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, scale=None):
    """Per-row, per-head softmax attention with K/V repeated to N heads."""
    B, T, N, H = q_BTNH.shape
    G = N // k_BSKH.shape[2]
    k = np.repeat(np.asarray(k_BSKH, np.float64), G, axis=2)
    v = np.repeat(np.asarray(v_BSKH, np.float64), G, axis=2)
    out = np.zeros((B, T, N, v.shape[-1]))
    scale = H ** -0.5 if scale is None else scale
    for b in range(B):
        for n in range(N):
            scores = q_BTNH[b, :, n] @ k[b, :, n].T * scale
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
    p = {k: np.asarray(v, np.float64) for k, v in _paths(params) if not k.startswith("groups/")}
    tokens = np.asarray(tokens_BT)
    B, T = tokens.shape
    positions = np.broadcast_to(np.arange(T), (B, T)) if positions_BT is None else positions_BT
    mask = causal_mask(T, segments_BT, B)

    def norm(x, name, p=p):
        return NORMS[config.norm](x, {k[len(name) + 1:]: v for k, v in p.items()
                                      if k.startswith(name + "/")}, config.norm_eps)

    def proj(x, equation, w, b, layer):
        y = np.einsum(equation, x, layer[w])
        return y + layer[b] if b in layer else y

    rope_scale, softmax_scale = (rope_and_softmax_scales(config) if config.positions == "rope"
                                 else (1.0, None))

    def rotate(x):
        if config.positions != "rope":
            return x
        return rope_scale * rope_meta(to_interleaved(x), positions, meta_inv_freq(config))

    x = p["embed/table"][tokens]
    if config.embed_scale:
        x = x * math.sqrt(config.dim)
    if config.positions == "sinusoidal":
        x = x + sinusoids(positions, config.dim)
    elif config.positions == "learned":
        x = x + p["positions/table"][positions]
    pre = config.norm_position == "pre"
    for layer in layers(params):
        h = norm(x, "attn_norm", layer) if pre else x
        if config.attention == "mla":
            q, k, v = mla_qkv(config, layer, h, rotate)
        else:
            q = rotate(proj(h, "btd,dnh->btnh", "attn/wq", "attn/bq", layer))
            k = rotate(proj(h, "btd,dkh->btkh", "attn/wk", "attn/bk", layer))
            v = proj(h, "btd,dkh->btkh", "attn/wv", "attn/bv", layer)
        x = x + proj(attention(q, k, v, mask, softmax_scale), "btnh,nhd->btd", "attn/wo",
                     "attn/bo", layer)
        if not pre:
            x = norm(x, "attn_norm", layer)
        h = norm(x, "mlp_norm", layer) if pre else x
        x = x + (moe(config, layer, h) if "mlp/router" in layer
                 else mlp(config.dense_mlp, layer, h))
        if not pre:
            x = norm(x, "mlp_norm", layer)
    if pre:
        x = norm(x, "final_norm")
    head = p["embed/table"].T if config.tie_embeddings else p["lm_head/w"]
    return x @ head


def mla_qkv(config, p, h, rotate):
    """DeepSeek-V2's MLA in its expanded form (eq. 9-19): per-head q, k, v from the latents
    c^Q = RMSNorm(h·W_DQ) (or h) and c^KV = RMSNorm(h·W_DKV), the shared key k^R rotated."""
    eps = 1e-6
    cq = rms_norm(h @ p["attn/wq_a"], p["attn/q_norm"], eps) if "attn/wq_a" in p else h
    q_c = np.einsum("btq,qnh->btnh", cq, p["attn/wq_nope"])
    q_r = rotate(np.einsum("btq,qnh->btnh", cq, p["attn/wq_rope"]))
    c_kv = rms_norm(h @ p["attn/w_dkv"], p["attn/kv_norm"], eps)
    k_c = np.einsum("btc,cnh->btnh", c_kv, p["attn/w_uk"])
    k_r = rotate((h @ p["attn/w_kr"])[:, :, None, :])
    v = np.einsum("btc,cnh->btnh", c_kv, p["attn/w_uv"])
    k = np.concatenate([k_c, np.repeat(k_r, k_c.shape[2], axis=2)], axis=-1)
    return np.concatenate([q_c, q_r], axis=-1), k, v


def route(logits_XE, top_k, router, normalize, scaling, n_groups=1, top_k_groups=1, bias=None):
    """Top-k routing token by token: (experts [X, R], weights [X, R], scores [X, E])."""
    z = np.asarray(logits_XE, np.float64)
    E = z.shape[-1]
    scores = (np.exp(z - z.max(-1, keepdims=True)) / np.exp(z - z.max(-1, keepdims=True)).sum(
        -1, keepdims=True) if router == "softmax" else 1 / (1 + np.exp(-z)))
    choice = scores + (0 if bias is None else np.asarray(bias, np.float64))
    experts, weights = [], []
    for x in range(len(z)):
        allowed = np.ones(E, bool)
        if n_groups > 1:
            groups = choice[x].reshape(n_groups, -1)
            group_score = (groups.max(-1) if router == "softmax"
                           else np.sort(groups, -1)[:, -2:].sum(-1))
            best = np.argsort(-group_score, kind="stable")[:top_k_groups]
            allowed = np.repeat(np.isin(np.arange(n_groups), best), E // n_groups)
        ranked = [e for e in np.argsort(-choice[x], kind="stable") if allowed[e]][:top_k]
        w = scores[x, ranked]
        if normalize:
            w = w / w.sum()
        experts.append(ranked)
        weights.append(w * scaling)
    return np.array(experts), np.array(weights), scores


def mlp(kind, p, x, prefix="mlp/"):
    """One MLP of `kind` on x (`p`: one layer's float64 weights by path; biases if present)."""
    def proj(x, name):
        y = x @ p[prefix + "w_" + name]
        return y + p[prefix + "b_" + name] if prefix + "b_" + name in p else y
    act = ACTIVATIONS[kind]
    hidden = act(proj(x, "gate")) * proj(x, "up") if kind in ("swiglu", "geglu") else (
        act(proj(x, "up")))
    return proj(hidden, "down")


def moe(config, p, x_BTD):
    """The MoE MLP without drops, token by token: Σ_r weight_r · Expert_{e_r}(x) + shared."""
    m = config.moe
    x_XD = x_BTD.reshape(-1, x_BTD.shape[-1])
    experts, weights, _ = route(x_XD @ p["mlp/router"], m.top_k, m.router, m.normalize_top_k,
                                m.routed_scaling, m.n_groups, m.top_k_groups,
                                p.get("mlp/selection_bias"))
    out = np.zeros_like(x_XD)
    for x in range(len(x_XD)):
        for e, w in zip(experts[x], weights[x]):
            expert = {k: v[e] for k, v in p.items() if k.startswith("mlp/experts/")}
            out[x] += w * mlp(m.expert_mlp, expert, x_XD[x], "mlp/experts/")
    if "mlp/shared/w_up" in p:
        out += mlp(m.expert_mlp, p, x_XD, "mlp/shared/")
    return out.reshape(x_BTD.shape)


def layers(params):
    """One {"attn/wq": ..., ...} per layer (float64), across the layer groups in order."""
    out = []
    for group in params["groups"]:
        flat = dict(_paths(group))
        n_layers = len(next(iter(flat.values())))
        out += [{k: np.asarray(v[i], np.float64) for k, v in flat.items()}
                for i in range(n_layers)]
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
