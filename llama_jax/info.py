"""Planner: sizes, bytes and FLOPs of a model without allocating it.

    python -m llama_jax.info PRESET_OR_CONFIG_FILE [--batch B] [--seq S] [--dtype D]
                             [--bandwidth GBPS] [--json]

All numbers come from `llama_jax.costs`; the formulas are printed next to the figures.
"""

from __future__ import annotations

import argparse
import json
import sys

from llama_jax import costs
from llama_jax.cli import user_errors_exit
from llama_jax.config import DTYPES, ConfigError, ModelConfig, load_model_config

DEFAULT_BANDWIDTH_GBPS = 3350.0  # H100 SXM HBM3


def plan(config: ModelConfig, *, batch: int, seq: int, dtype: str,
         bandwidth_gbps: float) -> dict:
    """Everything the planner reports, as plain data (the `--json` object)."""
    counts = costs.param_counts(config)
    kv_per_token = costs.kv_cache_bytes_per_token(config, dtype)
    step_bytes = costs.decode_bytes_per_step(config, batch, seq, dtype)
    floor_s = step_bytes / (bandwidth_gbps * 1e9)
    return {
        "config": {"D": config.D, "L": config.L, "N": config.N, "K": config.K, "H": config.H,
                   "F": config.F, "V": config.V, "max_seq_len": config.max_seq_len,
                   "tie_embeddings": config.tie_embeddings, "rope_theta": config.rope_theta,
                   "rope_type": config.rope_type},
        "n_params": counts.total,
        "n_params_embedding": counts.embedding,
        "n_params_lm_head": counts.lm_head,
        "n_params_non_embedding": counts.non_embedding,
        "n_params_matmul": counts.matmul,
        "weight_bytes": {d: counts.total * costs.dtype_bytes(d) for d in DTYPES},
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        "kv_cache_bytes_per_token": kv_per_token,
        "kv_cache_bytes": kv_per_token * batch * seq,
        "train_flops_per_token": costs.train_flops_per_token(config, seq),
        "train_flops_formula": costs.TRAIN_FLOPS_FORMULA,
        "decode_bytes_per_step": step_bytes,
        "decode_bytes_formula": costs.DECODE_BYTES_FORMULA,
        "bandwidth_gbps": bandwidth_gbps,
        "decode_floor_s_per_step": floor_s,
        "decode_floor_tokens_per_s": batch / floor_s,
    }


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024


def render(name: str, p: dict) -> str:
    c = p["config"]
    lines = [
        f"{name}: D={c['D']} L={c['L']} N={c['N']} K={c['K']} H={c['H']} F={c['F']} "
        f"V={c['V']} context={c['max_seq_len']} tied={c['tie_embeddings']} "
        f"rope_theta={c['rope_theta']:g} rope_type={c['rope_type']}",
        f"parameters           {p['n_params']:>20,}",
        f"  embedding (V*D)    {p['n_params_embedding']:>20,}",
        f"  LM head (untied)   {p['n_params_lm_head']:>20,}",
        f"  non-embedding      {p['n_params_non_embedding']:>20,}",
        f"  in matmuls (P_mm)  {p['n_params_matmul']:>20,}",
        "weight bytes         " + "  ".join(f"{d} {_bytes(b)}" for d, b in p["weight_bytes"].items()),
        f"KV cache ({p['dtype']})    {_bytes(p['kv_cache_bytes_per_token'])} per token "
        f"(2*L*K*H*bytes); {_bytes(p['kv_cache_bytes'])} for B={p['batch']} x S={p['seq']}",
        f"training FLOPs/token {p['train_flops_per_token']:,.4g} at T={p['seq']}  "
        f"[{p['train_flops_formula']}]",
        f"decode floor         {p['decode_floor_s_per_step'] * 1e3:.3f} ms/step, "
        f"{p['decode_floor_tokens_per_s']:,.1f} tokens/s at B={p['batch']}, S={p['seq']}, "
        f"{p['bandwidth_gbps']:g} GB/s  [{_bytes(p['decode_bytes_per_step'])} per step = "
        f"{p['decode_bytes_formula']}]",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llama_jax.info", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("config", help="preset name (e.g. llama3-8b) or path to a config file")
    parser.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    parser.add_argument("--seq", type=int, default=None,
                        help="sequence / context length S (default: the model's max_seq_len)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                        help="dtype of weights and KV cache for bytes and the decode floor")
    parser.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH_GBPS,
                        help="memory bandwidth in GB/s for the decode floor (default: H100 SXM)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = load_model_config(args.config)
    seq = config.max_seq_len if args.seq is None else args.seq
    for flag, value in (("--batch", args.batch), ("--seq", seq), ("--bandwidth", args.bandwidth)):
        if value <= 0:
            raise ConfigError(f"{flag}={value} must be > 0")
    result = plan(config, batch=args.batch, seq=seq, dtype=args.dtype,
                  bandwidth_gbps=args.bandwidth)
    print(json.dumps(result, indent=2) if args.json else render(args.config, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
