"""What the benchmark scripts share: the benchmark model, child processes, memory, the
language-modelling train step."""

from __future__ import annotations

import functools
import json
import resource
import subprocess
import sys
import time

import jax

import llama_jax
from llama_jax.training.step import objective, train_step

# The benchmark model: D=512, 8 layers, 8 heads, 4 KV heads, FFN 1536,
# vocab 8192.
BENCH_MODEL = llama_jax.ModelConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8,
                                    n_kv_heads=4, ffn_dim=1536, max_seq_len=2048)


def run_child(script: str, *args: str, python: str = sys.executable) -> dict:
    """Runs `python script *args` and returns the JSON object on its last stdout line. Each
    measurement gets a fresh process: torch's OpenMP threads keep spinning after a call and
    slow whatever runs next in the same process, and peak RSS is per process. `python` may be
    another environment's interpreter (another JAX release, say)."""
    out = subprocess.run([python, script, *args], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """VmHWM: this process image's peak RSS (ru_maxrss would include the parent's at fork)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def time_torch_train_steps(model, ids, warmup: int, steps: int, autocast=None) -> list[float]:
    """Seconds of each of `steps` transformers training steps (forward with labels, backward,
    `clip_grad_norm_(1.0)`, AdamW(lr 3e-4, betas 0.9/0.95, weight decay 0.1), `zero_grad`) after
    `warmup` untimed ones; `autocast` an optional torch autocast context."""
    import contextlib

    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        with autocast or contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def time_train_steps(compiled, state, batch, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` train steps (`compiled(state, batch) -> (state, metrics)`)
    after `warmup` untimed ones."""
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        metrics["loss"].block_until_ready()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def lm_train_step(config, train, optimizer, bos_id: int = 1):
    """The trainer's jitted language-modelling step on packed windows `[B, T + 1]` (BOS id
    `bos_id`), its state donated: `step(state, batch) -> (state, metrics)`."""
    loss_fn = objective(llama_jax.RunConfig(model=config, train=train), bos_id)
    return jax.jit(functools.partial(train_step, config, train, optimizer, loss_fn),
                   donate_argnums=0)


def medians(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Per name, the median of each figure over its rounds."""
    import statistics

    return {name: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            for name, rounds in results.items()}
