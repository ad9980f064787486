"""The compiler's clock (aot/estimate.py) and the execution defaults a pod run depends on.

XLA:TPU's cycle estimates count a loop body once: the estimate must weight it by its trip count,
so a scanned step and the same step unrolled agree. The defaults checked here are the ones a
team renting a slice would otherwise find out on the slice: the compute dtype follows the target
(bf16 on TPUs), presets load from an installed wheel, unrolled layers keep their remat.
"""

import contextlib
import dataclasses
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import load_run_config
from llama_jax.aot import estimate
from llama_jax.aot.training import compile_training, render
from llama_jax.config import ModelConfig
from llama_jax.parallel import sharding, target, topology
from llama_jax.training.trainer import jitted_programs

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.dim=512", "model.n_layers=3", "model.n_heads=8", "model.n_kv_heads=4",
        "model.vocab_size=2048", "model.max_seq_len=1024", "model.param_dtype=float32",
        "train.seq_len=256", "train.batch_size=8", "model.remat=full", "mesh.data=1",
        "mesh.fsdp=4"]
SLICE = "v5p-8"  # 4 chips

# A module as XLA:TPU writes it (trimmed): a 5-trip loop whose body holds a fusion of 100
# cycles and an all-gather over 4 devices, a conditional whose branches cost 7 and 3, a fusion
# of 10 cycles in the entry.
MODULE = """HloModule test, is_scheduled=true

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p), backend_config={"estimated_cycles":"999"}
}

%body (param: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %param = (s32[], bf16[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %f = bf16[4,8]{1,0} fusion(%param), kind=kLoop, calls=%fused, metadata={op_name="jit(step)/jvp()/while/body/closed_call/dot_general"}, backend_config={"flag_configs":[],"estimated_cycles":"100"}
  %ag = bf16[4,8]{1,0} all-gather(%f), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %rs = bf16[1,8]{1,0} fusion(%ag), kind=kCustom, calls=%all-reduce-scatter.1, replica_groups=mesh['a'=2,'b'=4] {'b'}
  ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%i, %ag)
}

%cond (param.1: (s32[], bf16[4,8])) -> pred[] {
  %param.1 = (s32[], bf16[4,8]{1,0}) parameter(0)
  %c = s32[] constant(5)
  %i.1 = s32[] get-tuple-element(%param.1), index=0
  ROOT %lt = pred[] compare(%i.1, %c), direction=LT
}

%cheap (x: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  ROOT %b = f32[] negate(%x), backend_config={"estimated_cycles":"3"}
}

%dear (y: f32[]) -> f32[] {
  %y = f32[] parameter(0)
  ROOT %d = f32[] negate(%y), backend_config={"estimated_cycles":"7"}
}

ENTRY %main (a: (s32[], bf16[4,8]), k: pred[], z: f32[]) -> f32[] {
  %a = (s32[], bf16[4,8]{1,0}) parameter(0)
  %k = pred[] parameter(1)
  %z = f32[] parameter(2)
  %w = (s32[], bf16[4,8]{1,0}) while(%a), condition=%cond, body=%body
  %e = f32[] fusion(%z), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"10"}
  ROOT %r = f32[] conditional(%k, %e, %e), true_computation=%cheap, false_computation=%dear
}
"""


def test_the_estimate_weights_loop_bodies_by_their_trips():
    clock, ici = 1e9, 1e3
    step = estimate.estimate(MODULE, clock, peak_flops=1e12, ici_bandwidth=ici)
    assert step.cycles == 10 + 5 * 100 + 7  # fused insides not counted; the dearer branch
    assert step.unweighted_cycles == 10 + 100 + 7  # each body once, as XLA sums it
    assert step.seconds == pytest.approx(517 / clock)
    gather, scatter = step.collectives
    assert (gather.kind, gather.count, gather.bytes) == ("all-gather", 5, 5 * 4 * 8 * 2)
    assert gather.seconds == pytest.approx(5 * 64 * 3 / 4 / ici)  # a ring's (n-1)/n
    # XLA:TPU's reduce-scatter is a fusion; its result is a shard, its traffic n - 1 shards
    assert (scatter.kind, scatter.count, scatter.bytes) == ("reduce-scatter", 5, 5 * 8 * 2)
    assert scatter.seconds == pytest.approx(5 * 16 * 3 / ici)
    assert step.top_ops[0] == estimate.TopOp("forward layer/dot_general", "fusion", 5,
                                             500 / clock)
    assert "517 ns" not in "\n".join(step.report_lines())  # durations in readable units
    assert step.mfu(model_flops=517e-9 * 1e12 / 2) == pytest.approx(0.5)


def test_an_instruction_xla_could_not_price_counts_nothing():
    """XLA:TPU writes INT64_MAX as the estimate of an instruction it has none for (its gather
    offload fusions): that is no price, not 2^63 cycles."""
    module = MODULE.replace('"estimated_cycles":"10"', '"estimated_cycles":"9223372036854775807"')
    assert estimate.estimate(module, 1e9, peak_flops=1e12).cycles == 5 * 100 + 7


def test_a_loop_s_trips_are_read_off_its_counter_s_start_and_step():
    """XLA:TPU's windowed einsums unroll their loop twice and step the counter by 2 (tensor=8:
    2 trips of `i < 4`, 4 chunks each); a counter may start past 0. Here it starts at 1 (a
    copied constant), steps by 2 and stops before 7: 3 trips."""
    module = MODULE.replace("%c = s32[] constant(5)", "%c = s32[] constant(7)").replace(
        "ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%i, %ag)",
        "%two = s32[] constant(2)\n  %next = s32[] add(%i, %two)\n"
        "  ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%next, %ag)").replace(
        "%w = (s32[], bf16[4,8]{1,0}) while(%a)",
        "%one = s32[] constant(1)\n  %first = s32[] copy(%one)\n"
        "  %x = bf16[4,8]{1,0} get-tuple-element(%a), index=1\n"
        "  %in = (s32[], bf16[4,8]{1,0}) tuple(%first, %x)\n"
        "  %w = (s32[], bf16[4,8]{1,0}) while(%in)")
    step = estimate.estimate(module, 1e9, peak_flops=1e12)
    assert step.cycles == 10 + 3 * 100 + 7 and step.unknown_loops == ()
    assert step.collectives[0].count == 3


def test_a_loop_without_a_constant_trip_count_is_counted_once_and_said():
    module = MODULE.replace("%c = s32[] constant(5)", "%c = s32[] get-tuple-element(%param.1), index=0")
    step = estimate.estimate(module, 1e9, peak_flops=1e12)
    assert step.cycles == 10 + 100 + 7 and step.unknown_loops == ("w",)
    assert step.collectives[0].seconds is None  # no ICI bandwidth given: bytes only


# A module as XLA:GPU writes it under --xla_gpu_collect_cost_model_stats (trimmed): a loop of
# 4 trips (XLA's known_trip_count; its condition is a fusion, no constant to read) whose body
# runs a loop fusion (10 us by the default model, 99 by "sol"), a Triton softmax (85 ms by the
# default model, 2 us by the indexing model), a cuBLAS GEMM [64, 128] x [128, 256], a fusion
# on another stream (3 us) and a copy of a tuple element; then causal cuDNN attention once.
_COST = '"reification_cost":[{{"exec_time_us":{},"name":""}},{{"exec_time_us":99,"name":"sol"}}'
GPU_MODULE = """HloModule gpu, is_scheduled=true

%fused_neg (p: f32[64,256]) -> f32[64,256] {
  %p = f32[64,256]{1,0} parameter(0)
  ROOT %n = f32[64,256]{1,0} negate(%p)
}

%async_computation (q: f32[64,256]) -> f32[64,256] {
  %q = f32[64,256]{1,0} parameter(0)
  ROOT %side = f32[64,256]{1,0} fusion(%q), kind=kLoop, calls=%fused_neg, backend_config={C3}]}
}

%body (arg_tuple: (s32[], bf16[64,128], bf16[128,256])) -> (s32[], bf16[64,128], bf16[128,256]) {
  %arg_tuple = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %loop = f32[64,256]{1,0} fusion(%arg_tuple#1), kind=kLoop, calls=%fused_neg, metadata={op_name="jit(step)/jvp()/while/body/closed_call/add"}, backend_config={C10}]}
  %soft = f32[64,256]{1,0} fusion(%loop), kind=kCustom, calls=%fused_neg, backend_config={"fusion_backend_config":{"kind":"__triton"},"reification_cost":[{"exec_time_us":85000,"name":""},{"exec_time_us":2,"name":"indexing-cost-model"}]}
  %gemm = (bf16[64,256]{1,0}, s8[1024]{0}) custom-call(%arg_tuple#1, %arg_tuple#2), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}},"reification_cost":[{"exec_time_us":5637,"name":"sol"}]}
  %start = ((f32[64,256]{1,0}), f32[64,256]{1,0}, u32[]) async-start(%soft), calls=%async_computation
  %done = f32[64,256]{1,0} async-done(%start)
  %copy = bf16[128,256]{0,1} copy(%arg_tuple#2)
  %i = s32[] get-tuple-element(%arg_tuple), index=0
  ROOT %t = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%i, %arg_tuple#1, %copy)
}

%cond (arg_tuple.1: (s32[], bf16[64,128], bf16[128,256])) -> pred[] {
  %arg_tuple.1 = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  ROOT %lt = pred[] fusion(%arg_tuple.1), kind=kLoop, calls=%fused_neg
}

ENTRY %main (a: (s32[], bf16[64,128], bf16[128,256]), q: bf16[2,128,4,64]) -> bf16[2,4,128,64] {
  %a = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(1)
  %w = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %fmha = (bf16[2,4,128,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["2","4","128","128"]},"mask_type":"CAUSAL"}}
}
""".replace("{C3}", "{" + _COST.format(3)).replace("{C10}", "{" + _COST.format(10))


def test_the_gpu_estimate_takes_xla_s_prices_and_adds_the_library_calls():
    peak, bandwidth = 1e12, 1e9
    step = estimate.estimate_gpu(GPU_MODULE, peak, bandwidth)
    us = 1e-6
    # XLA's: the loop fusion by the default model, the Triton one by the indexing model, the
    # fusion on the other stream; 4 trips each
    assert step.priced_seconds == pytest.approx(4 * (10 + 2 + 3) * us)
    assert step.unweighted_seconds == pytest.approx((10 + 2 + 3) * us)
    gemm = max(2 * 64 * 256 * 128 / peak, (64 * 128 + 128 * 256 + 64 * 256) * 2 / bandwidth)
    copy = 2 * 128 * 256 * 2 / bandwidth
    attention = max(2 * (2 * 2 * 4 * 128 * 128 * 64) * 0.5 / peak,  # two causal matmuls
                    4 * (2 * 4 * 128 * 64) * 2 / bandwidth)  # or q, k, v read, out written
    assert step.kernel_seconds == pytest.approx(4 * (gemm + copy) + attention)
    assert dict(step.kernels) == {"gemm": 4, "copy": 4, "attention forward": 1}
    # kernels: per trip the loop fusion, the softmax, the GEMM, the side fusion, the copy;
    # the condition's fusion once more than the trips; the attention call
    assert step.launches == 4 * 5 + 5 + 1 and step.unknown_loops == ()
    assert step.unpriced == 5  # the condition's fusion: XLA wrote no price on it
    assert step.clock_hz is None and step.cycles == 0
    text = "\n".join(step.report_lines())
    assert "26 kernels launched per call; 5 unpriced" in text and "XLA:GPU" in text


# A decode step's cuDNN attention as XLA:GPU writes it (trimmed): its backend config spaced,
# other fields before the scores' shape [B, N, T, S].
FMHA_DECODE = """HloModule decode, is_scheduled=true

ENTRY %main (q: bf16[1,32,1,128], k: bf16[1,8,256,128], v: bf16[1,8,256,128], n: s32[1]) -> bf16[1,32,1,128] {
  %q = bf16[1,32,1,128]{3,2,1,0} parameter(0)
  %k = bf16[1,8,256,128]{3,2,1,0} parameter(1)
  %v = bf16[1,8,256,128]{3,2,1,0} parameter(2)
  %n = s32[1]{0} parameter(3)
  %fmha = (bf16[1,32,1,128]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v, %n, %n), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"operation_queue_id": "0", "cudnn_fmha_backend_config": {"algorithm": {"algo_id": "0", "is_cudnn_frontend": true}, "fmha_scale": 0.088, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["1", "32", "1", "256"], "layout": {"minor_to_major": ["3", "2", "1", "0"]}}, "mask_type": "PADDING"}}
  ROOT %out = bf16[1,32,1,128]{3,2,1,0} get-tuple-element(%fmha), index=0
}
"""


@pytest.mark.parametrize("bandwidth", [1e9, 1e15])
def test_a_cudnn_attention_call_is_priced_at_its_flops_or_its_bytes(bandwidth):
    """Its two matmuls' FLOPs (from the scores' shape) or what it reads and writes, whichever
    takes longer: one query a row over the cache is the bytes (a bandwidth of 1e9), and at a
    bandwidth of 1e15 the FLOPs."""
    peak = 1e12
    step = estimate.estimate_gpu(FMHA_DECODE, peak, bandwidth)
    flops = 2 * (2 * 32 * 256 * 128)  # scores and values, every key visible
    moved = (32 * 128 + 2 * 8 * 256 * 128 + 32 * 128) * 2 + 2 * 4  # q, k, v, out; lengths
    assert step.kernel_seconds == pytest.approx(max(flops / peak, moved / bandwidth))
    assert dict(step.kernels) == {"attention forward": 1} and step.launches == 1


# A decode step's cache write as XLA:GPU compiles it (trimmed): one row's keys [1, 8, 128],
# computed from fp32 partial sums [4, 8, 1024], scattered in place into a [1, 1024, 128]
# cache; XLA's model prices the fusion at 50 us, as if it rewrote the cache.
SCATTER_MODULE = """HloModule scatter, is_scheduled=true

%fused_scatter (c: bf16[1,1024,128], i: s32[8,2], u: f32[4,8,1024]) -> bf16[1,1024,128] {
  %c = bf16[1,1024,128]{2,1,0} parameter(0)
  %i = s32[8,2]{1,0} parameter(1)
  %u = f32[4,8,1024]{2,1,0} parameter(2)
  %r = f32[8,1024]{1,0} reduce(%u, %z), dimensions={0}, to_apply=%add
  %k = bf16[8,128]{1,0} convert(%r)
  ROOT %s = bf16[1,1024,128]{2,1,0} scatter(%c, %i, %k), update_window_dims={1}
}

ENTRY %main (cache: bf16[1,1024,128], idx: s32[8,2], parts: f32[4,8,1024]) -> bf16[1,1024,128] {
  %cache = bf16[1,1024,128]{2,1,0} parameter(0)
  %idx = s32[8,2]{1,0} parameter(1)
  %parts = f32[4,8,1024]{2,1,0} parameter(2)
  ROOT %w = bf16[1,1024,128]{2,1,0} fusion(%cache, %idx, %parts), kind=kInput, calls=%fused_scatter, backend_config={C50}]}
}
""".replace("{C50}", "{" + _COST.format(50))


def test_the_gpu_estimate_prices_a_scatter_at_the_bytes_it_moves_not_its_whole_array():
    """An in-place scatter fusion (a KV-cache write) reads its other operands and writes its
    updates; XLA's model priced it as rewriting the whole cache."""
    bandwidth = 1e9
    step = estimate.estimate_gpu(SCATTER_MODULE, 1e12, bandwidth)
    assert step.priced_seconds == 0 and dict(step.kernels) == {"scatter": 1}
    assert step.kernel_seconds == pytest.approx((8 * 2 * 4 + 4 * 8 * 1024 * 4 + 8 * 128 * 2)
                                                / bandwidth)
    assert step.launches == 1


def tpu_devices():
    assert topology._tpu_compiler_found(), "needs libtpu: `make test` installs it"
    return topology.devices(topology.parse(SLICE))


@pytest.fixture(scope="module")
def steps():
    """The tiny run's training step compiled for the slice, scanned and unrolled."""
    tpu_devices()
    return {scan: compile_training(load_run_config(
        "configs/tiny.yaml", [*TINY, f"model.scan_layers={scan}"]), SLICE, evaluate=False)
        for scan in ("true", "false")}


def test_a_scanned_step_is_priced_as_its_unrolled_twin(steps):
    """Within 20%: the rest is the scan's own work as XLA prices it (each layer's weights
    sliced from the stack and cast, its gradients written back into it; 8% at this size),
    which grows with the layers' count, not their width: matmuls dominate an 8B step."""
    scanned, unrolled = (steps[s].programs[0].clock for s in ("true", "false"))
    assert scanned.seconds == pytest.approx(unrolled.seconds, rel=0.20)
    assert scanned.seconds >= unrolled.seconds  # a loop's bookkeeping costs, never saves
    # XLA's own sum counts the scan's body once: far below the weighted figure
    assert scanned.unweighted_cycles < 0.6 * scanned.cycles
    assert unrolled.unweighted_cycles == pytest.approx(unrolled.cycles, rel=0.01)
    # splash's Mosaic kernels, unpriced by XLA, are added: forward, recomputed forward, dq,
    # dkv per layer under full remat
    assert scanned.kernel_seconds == pytest.approx(unrolled.kernel_seconds)
    assert scanned.kernel_seconds > 0


@pytest.mark.parametrize("scan", ["true", "false"])
def test_full_remat_recomputes_every_layer_scanned_or_unrolled(steps, scan):
    """An unrolled loop under jax.checkpoint needs its CSE barrier: without it XLA merges the
    recomputed forward with the saved one (half the forward kernels, far more memory)."""
    kernels = dict(steps[scan].programs[0].clock.kernels)
    # per layer: the forward, its recomputation, dq and dkv
    assert kernels == {"forward": 2 * 3, "dq": 3, "dkv": 3}, kernels


def test_the_report_prints_the_clock_and_the_automatic_dtype(steps):
    report = steps["true"]
    run = load_run_config("configs/tiny.yaml", TINY)
    text = render(report, run)
    assert "bfloat16 (auto) compute" in text
    assert "XLA's clock" in text and "MFU" in text and "top ops" in text
    as_dict = report.as_dict()
    assert as_dict["programs"][0]["clock"]["cycles"] == report.programs[0].clock.cycles
    assert report.model_flops > 0


def test_the_compute_dtype_follows_the_target_unless_set():
    tiny = dict(vocab_size=64, dim=32, n_layers=1, n_heads=2)
    here = ModelConfig(**tiny)
    assert (here.compute_dtype, here.compute_dtype_auto) == ("float32", True)  # the CPU's
    with target.compiling_for(tpu_devices()):
        assert ModelConfig(**tiny).compute_dtype == "bfloat16"
        assert here.for_platform().compute_dtype == "bfloat16"
        assert here.with_execution(remat="full").compute_dtype == "bfloat16"
        explicit = ModelConfig(**tiny, compute_dtype="float32")
        assert explicit.for_platform().compute_dtype == "float32"
    preset = load_run_config("llama3-8b", []).model
    assert preset.compute_dtype_auto and preset.to_dict()["compute_dtype"] == "float32"
    assert type(preset.to_dict()["compute_dtype"]) is str  # plain data for YAML
    assert ModelConfig(**preset.__dict__) == preset  # rebuilt from its fields, still chosen
    assert ModelConfig(**preset.__dict__).compute_dtype_auto
    assert not load_run_config("llama3-8b", ["model.compute_dtype=float32"]).model \
        .compute_dtype_auto


def test_presets_load_from_an_installed_wheel(tmp_path):
    """A non-editable install has no repository around it: the presets ship in the package."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("llama_jax", "configs"):
        shutil.copytree(ROOT / name, source / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    script = ("import llama_jax, sys; from llama_jax import load_run_config; "
              "from llama_jax.config import list_presets; "
              "assert llama_jax.__file__.startswith(sys.argv[1]), llama_jax.__file__; "
              "m = load_run_config('llama3-8b', []).model; "
              "print(m.dim, m.vocab_size, m.rope_theta, len(list_presets()))")
    out = subprocess.run([sys.executable, "-c", script, str(site)], cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin",
                              "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    dim, vocab, theta, presets = out.stdout.split()
    assert (dim, vocab, float(theta)) == ("4096", "128256", 500000.0)
    assert int(presets) == len(list((ROOT / "configs").glob("[!_]*.yaml")))


@pytest.mark.parametrize("equation, x_shape, w_shape", [
    ("BTD,DNH->BTNH", (2, 3, 16), (16, 4, 8)), ("BTNH,NHD->BTD", (2, 3, 4, 8), (4, 8, 16)),
    # fewer rows than a TPU's sublane tile: padded to 8 (9) rows there, then cut back
    ("BTD,DNH->BTNH", (1, 1, 16), (16, 4, 8)), ("BTD,DF->BTF", (3, 1, 16), (16, 24)),
    ("BTD,DF->BTF", (1, 3, 16), (16, 24))])
def test_an_accelerators_matmul_equals_the_cpus(equation, x_shape, w_shape):
    """On TPUs and GPUs `dense` is the einsum as written (the partitioner gathers each FSDP
    weight as stored), on a TPU with a decode step's few rows padded to 8; on CPUs one 2-D
    matmul. Traced for a TPU and run here, the same numbers, and the same logits."""
    from llama_jax.nn.heads import lm_head
    from llama_jax.nn.ops import dense
    k1, k2 = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(k1, x_shape), jax.random.normal(k2, w_shape)
    config = ModelConfig(vocab_size=24, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    head = {"lm_head": {"w": w}} if w.ndim == 2 else None
    here = dense(equation, x, w), head and lm_head(config, head, x)
    with target.compiling_for(tpu_devices()):
        there = dense(equation, x, w), head and lm_head(config, head, x)
        assert target.platform() == "tpu"
        lowered = jax.jit(lambda x: dense(equation, x, w)).lower(x).as_text()
    np.testing.assert_allclose(there[0], here[0], rtol=1e-6, atol=1e-6)
    if head:
        np.testing.assert_allclose(there[1], here[1], rtol=1e-6, atol=1e-6)
    rows = int(np.prod(x_shape[:-1 if "BTD," in equation else -2]))
    assert ("stablehlo.pad" in lowered) == (rows < 8)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8"])
def test_an_accelerators_per_layer_cache_holds_floats_written_once_per_step(cache_dtype):
    """The unrolled decoder's per-layer cache: for a CPU 16-bit values are kept as their uint16
    bits (XLA:CPU's in-place update needs them), for an accelerator as floats; either way a
    step writes each layer's keys and values in one update of all KV heads (head by head, a
    GPU's step ran a kernel per head). Traced for a TPU and run here: the CPU's numbers."""
    from llama_jax import init_params
    from llama_jax.model.kv_cache import init_cache
    from llama_jax.model.transformer import apply, unstack_layers
    config = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         ffn_dim=64, max_seq_len=32).with_execution(compute_dtype="bfloat16")
    layers = unstack_layers(init_params(config, jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, 96, (2, 7))

    def run():
        cache = init_cache(config, 2, 16, cache_dtype, layout="per_layer")
        step = jax.jit(lambda t, c: apply(config, layers, t, cache=c)[:2])
        h, cache = step(tokens[:, :6], cache)
        h2, cache = step(tokens[:, 6:], cache)
        return np.concatenate([h, h2], 1).astype(np.float32), cache.groups[0][0].k, \
            step.lower(tokens[:, 6:], cache).as_text()

    here, stored_here, _ = run()
    with target.compiling_for(tpu_devices()):
        there, stored_there, lowered = run()
    if cache_dtype == "bfloat16":
        assert (stored_here.dtype, stored_there.dtype) == (np.uint16, jax.numpy.bfloat16)
    np.testing.assert_allclose(there, here, rtol=2e-2, atol=2e-2)
    updates = 2 * config.n_layers * (2 if cache_dtype == "int8" else 1)  # k, v (and scales)
    assert lowered.count("stablehlo.dynamic_update_slice") == updates


def test_a_batch_1_decode_step_on_a_v5e_runs_near_its_hbm_floor(monkeypatch):
    """One decode step at batch 1 compiled for a v5e, on XLA:TPU's clock: its matmuls, padded
    to 8 rows, stay on the MXUs; one row each, XLA rewrites them as multiplies and reductions
    on the vector units, priced 3-4x the time their weights take to read."""
    from llama_jax.aot.decoding import compile_decoding
    from llama_jax.nn import ops
    config = ModelConfig(vocab_size=4096, dim=1024, n_layers=2, n_heads=8, n_kv_heads=4,
                         ffn_dim=4096, max_seq_len=512)
    cases = [("unrolled", "bfloat16", "bfloat16"), ("scan", "int8", "bfloat16")]
    padded = compile_decoding(config, "v5e-1", batch=1, context=256, cases=cases)
    monkeypatch.setattr(ops, "MIN_ROWS", 1)
    single = compile_decoding(config, "v5e-1", batch=1, context=256, cases=cases[:1])
    assert padded[0].floor_ratio <= 1.25, padded[0].floor_ratio  # the goal, bf16 unrolled
    for p, s in zip(padded, single):
        assert p.step.clock.seconds < 0.6 * s.step.clock.seconds, (p.decode_impl, p.weights)


@pytest.mark.skipif(topology.cuda_plugin() is None,
                    reason="jax's CUDA plugin is not installed (pip install "
                           "jax-cuda12-plugin==<jax's version>; make test leaves it out)")
@pytest.mark.parametrize("batch, context, kernels, floor",
                         [(1, 256, 19, 1.06), (8, 256, 16, 1.08), (8, 8192, 22, 1.10)])
def test_a_decode_step_on_an_h100_launches_few_kernels_near_its_floor(batch, context, kernels,
                                                                      floor):
    """The unrolled decoder's step for one H100 at LLaMA-3 8B's layer widths, on XLA:GPU's
    clock: kernels a layer (the second layer's: at batch 1 / 8, 21 / 17 with the gate and up
    matmuls apart, 20 / 16 with them merged, `nn.mlp._merges`, 19 at batch 1 with W_O's one
    row unpadded, `ops.row_tiled`) and the step's time against its HBM floor (1.03x / 1.06x;
    1.05x / 1.09x with the cache writes at XLA's price). At 8 rows of 8,192 slots, where the
    cache is most of what a step reads, the attention is grouped (`gqa.grouped_decode`):
    1.10x the floor, where block-diagonally it was 1.58x."""
    from llama_jax.aot.decoding import compile_decoding
    steps = [compile_decoding(ModelConfig(vocab_size=4096, dim=4096, n_layers=layers,
                                          n_heads=32, n_kv_heads=8, ffn_dim=14336,
                                          max_seq_len=max(512, context)),
                              "h100x1", batch=batch, context=context,
                              cases=[("unrolled", "bfloat16", "bfloat16")])[0]
             for layers in (1, 2)]
    per_layer = steps[1].step.clock.launches - steps[0].step.clock.launches
    assert per_layer <= kernels, per_layer
    assert steps[1].floor_ratio <= floor, steps[1].floor_ratio


def test_fsdp_gathers_weights_by_all_gather_on_a_torus():
    """On a torus slice (v5p-128: 4x4x4 chips, wraparound on every side, as the real one has)
    FSDP's weight gathers are all-gathers, forward and in the backward's recomputation; the
    only full-size all-reduces are the gradients' (XLA:TPU's choice over reduce-scatter, as it
    makes for MaxText's step). Described as an open mesh of chips, XLA:TPU instead wrote each
    shard into a zero-filled full-size buffer and all-reduced it: twice the bytes, plus the
    fills."""
    devices = topology.devices(topology.parse("v5p-128"))
    run = load_run_config("configs/tiny.yaml", [*TINY, "mesh.fsdp=64", "train.batch_size=64"])
    mesh = sharding.make_mesh(run.mesh, devices)
    with target.compiling_for(mesh):
        run = dataclasses.replace(run, model=run.model.for_platform())
    with target.compiling_for(mesh), sharding.use_mesh(mesh, run.mesh):
        text = jitted_programs(run, 1, mesh).lower_step().compile().as_text()
    # one layer's weights, full size: attention's q, k/v, o and the MLP's matrices
    D, F, H = run.model.dim, run.model.ffn_dim, run.model.head_dim
    N, K = run.model.n_heads, run.model.n_kv_heads
    layer = {(D, N, H), (D, K, H), (N, H, D), (D, F), (F, D)}
    gathered, reduced = _weight_collectives(text, layer)
    assert gathered.keys() == layer, gathered
    assert all(2 <= n for n in gathered.values()), gathered  # the forward and its recomputation
    assert reduced and all("transpose(" in name for name in reduced), reduced  # gradients only
    # the embedding's gradient rows reach the table's layout in bf16, widened after the move
    # (`nn.ops.lookup`; the partitioner moved them in fp32: twice the bytes)
    moved = re.findall(r"= (\w+)\[[^\n]* all-to-all\([^\n]*op_name=\"([^\"]*)\"", text)
    assert any("transpose(" in name for _, name in moved), moved  # the backward's
    assert all(dtype == "bf16" for dtype, _ in moved), moved


def _weight_collectives(text: str, layer: set) -> tuple[dict, list]:
    """All-gathers by the layer weight shape they produce (a leading 1 of the layer slice
    dropped), and the op names of all-reduces that produce one."""
    computations, _ = estimate.parse_module(text)
    gathered, reduced = {}, []
    for instruction in (i for c in computations.values() for i in c):
        kind = instruction.opcode.removesuffix("-start").removesuffix("-done")
        shapes = {tuple(int(d) for d in dims.split(",") if d)
                  for _, dims in re.findall(r"(\w+)\[([\d,]*)\]", instruction.shape)}
        shapes = {shape[1:] if shape[:1] == (1,) else shape for shape in shapes} & layer
        if kind == "all-gather" and not instruction.opcode.endswith("-done"):
            for shape in shapes:
                gathered[shape] = gathered.get(shape, 0) + 1
        elif kind == "all-reduce" and shapes and not instruction.opcode.endswith("-done"):
            reduced.append(instruction.op_name)
    return gathered, reduced


@pytest.mark.parametrize("name, wrap", [
    ("v5p-64", (False, False, False)), ("v5p-128", (True, True, True)),
    ("v5p-512", (True, True, True)), ("v4-128", (True, True, True)),
    ("v5e-64", (False, False, False)), ("v5e-128", (False, True, False)),
    ("v6e-256", (True, True, False))])
def test_slices_close_their_rings_as_the_real_ones(name, wrap):
    """Wraparound links: every side of a 3-D slice of 4x4x4 chips and up, a 16-chip side of a
    2-D one (Google's slice shapes, as MaxText's compile table has them)."""
    assert topology.parse(name).wrap == wrap


def small_step(**execution):
    """A 2-layer GQA model with a gated MLP, its random parameters and a window of 2 x 17
    random tokens, for a training step's loss."""
    from llama_jax.model.params import init_params
    config = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48,
                         **execution)
    return (config, init_params(config, jax.random.key(0)),
            jax.random.randint(jax.random.key(1), (2, 17), 2, 64))


@pytest.mark.parametrize("remat", ["dots", "dots_no_batch", "dots_with_attention"])
def test_the_saving_policies_keep_the_rotated_queries_and_keys_alone(remat):
    """The policies that save projections save RoPE's outputs in place of the q and k
    projections, not beside them, and nothing of the rotation itself (in a TPU program each
    feature's partner is a matmul's output, which they would otherwise save, in fp32)."""
    from llama_jax.training.step import loss_sums
    config, params, window = small_step(attention_impl="chunked", attention_block_q=8,
                                        attention_block_kv=8, remat=remat, scan_layers=False)
    printed = io.StringIO()
    with target.compiling_for(tpu_devices()), contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(
            lambda p: loss_sums(config, p, window, 1, 0.0)[0], params)
    saved = printed.getvalue().splitlines()
    assert not any("swapped_halves" in line for line in saved)
    # [B, T, N, H], as attention's output: one query array a layer, RoPE's (named "query"
    # too where attention's inputs and output are saved)
    queries = [line for line in saved if line.startswith("f32[2,16,2,16]")
               and "named 'attention'" not in line]
    assert len(queries) == config.n_layers
    assert all("named 'rotated'" in line or "named 'query'" in line for line in queries)


def test_the_fences_hold_in_a_tpu_program_and_change_no_number():
    """`ops.fenced` (the gated MLP's hidden state and its backward pass, a block norm's
    gradient) is an optimization barrier in a program for a TPU and nothing elsewhere, and
    RoPE takes its partner features by a matmul there (`rope.swapped_halves`). Traced
    for a TPU and run here: the loss and every gradient as the CPU's program has them, and the
    MLP's as autodiff of the plain expression has them."""
    from llama_jax.nn.mlp import apply_mlp
    from llama_jax.training.step import loss_sums
    config, params, window = small_step(attention_impl="xla")
    loss = jax.value_and_grad(lambda p: loss_sums(config, p, window, 1, 1e-2)[0])
    here = loss(params)
    with target.compiling_for(tpu_devices()):
        there = loss(params)
        lowered = jax.jit(loss).lower(params).as_text()
    assert "optimization_barrier" in lowered
    on_cpu = jax.jit(loss).lower(params).as_text()
    assert "optimization_barrier" not in on_cpu
    # RoPE's partners by a permutation matmul: q and k, forward and backward (in the layers'
    # scanned body, written once)
    assert lowered.count("dot_general") == on_cpu.count("dot_general") + 2 * 2
    for a, b in zip(jax.tree.leaves(here), jax.tree.leaves(there)):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()

    x = jax.random.normal(jax.random.key(2), (2, 5, 32))
    p = jax.tree.map(lambda w: w[0], params["groups"][0]["mlp"])  # the first layer's

    def plain(p, x):
        return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]
    want = jax.grad(lambda p, x: jnp.sum(plain(p, x) ** 2), (0, 1))(p, x)
    # the up matmuls recomputed in the backward pass (their outputs fenced too) or saved
    for remat in ("full", "dots_no_batch"):
        mlp_config = dataclasses.replace(config, remat=remat)
        with target.compiling_for(tpu_devices()):
            got = jax.grad(lambda p, x: jnp.sum(apply_mlp(mlp_config, p, x) ** 2), (0, 1))(p, x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), remat
