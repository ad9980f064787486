"""Compiling for hardware this host does not have: TPU slices through libtpu's compile-only
devices (`make test` installs libtpu where JAX finds it only through TPU_LIBRARY_PATH, so the
rest of the suite and the demo never start a TPU backend), GPU nodes through jax's CUDA plugin
where it is installed. Every execution choice must follow the mesh's platform: a tiny model's
step compiled for a TPU runs splash attention as Mosaic kernels and none of the CPU's
workarounds, and its memory is XLA:TPU's own, checked against the planner."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from llama_jax import load_run_config
from llama_jax.aot.compiled import custom_calls, out_of_memory
from llama_jax.aot.serving import compile_serving, render as render_serving
from llama_jax.aot.training import compile_training, render
from llama_jax.decode.decoder import memory_need, resolve_decode_impl
from llama_jax.config import MeshConfig
from llama_jax.errors import ConfigError
from llama_jax.model.params import abstract_params
from llama_jax.nn.attention.dot_product import Mask, chosen_attention, dot_product_attention
from llama_jax.parallel import sharding, target, topology
from llama_jax.training.trainer import jitted_programs

from checkpoints import tiny_checkpoint_with_tokenizer

ROOT = Path(__file__).resolve().parent.parent
MOSAIC = "tpu_custom_call"
# A tiny LLaMA whose activations, not XLA's fixed buffers, make most of its memory, so the
# planner's figure means something at this size (bf16 compute, fp32 parameters and AdamW).
TINY = ["model.dim=256", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.vocab_size=2048", "model.max_seq_len=1024", "model.compute_dtype=bfloat16",
        "model.param_dtype=float32", "train.seq_len=1024", "train.batch_size=16"]
# XLA:TPU's peak / the planner's total for TINY (remat none): 0.81 on v5e, 1.03 on v5p. At
# this size XLA's fixed buffers and its fusion choices move the ratio more than at pod scale
# (0.93-1.06 from 8B to 405B, docs/scale-out.md), hence the wider band.
PLAN_BOUND = (0.75, 1.15)


def tpu_devices(name: str, slices: int = 1) -> list:
    assert topology._tpu_compiler_found(), (
        "these tests compile for TPUs and need libtpu: `make test` installs it "
        "(TPU_LIBRARY_PATH), or pip install 'jax[tpu]'")
    return topology.devices(topology.parse(name, slices))


@pytest.mark.parametrize("name, libtpu, devices, megacore", [
    ("v4-8", "v4:2x2x1", 4, True),
    ("v5p-256", "v5p:4x4x8", 128, True),
    ("v5p-1024", "v5p:8x8x8", 512, True),
    ("v5p-2048", "v5p:8x8x16", 1024, True),
    ("v5e-1", "v5e:1x1", 1, False),
    ("v5e-8", "v5e:2x4", 8, False),
    ("v5litepod-256", "v5e:16x16", 256, False),
    ("v6e-64", "v6e:8x8", 64, False),
    ("v5p:2x2x1", "v5p:2x2x1", 4, True),
    ("v5e:2x2", "v5e:2x2", 4, False),
])
def test_slice_names_are_chip_grids(name, libtpu, devices, megacore):
    named = topology.parse(name)
    assert (named.libtpu_name, named.n_devices, named.megacore) == (libtpu, devices, megacore)


@pytest.mark.parametrize("name, slices, message", [
    ("v5p-6", 1, "power of two"),
    ("v5p-4", 1, "8 or a larger"),
    ("v5e-2", 1, "v5e-N names a slice of N chips"),
    ("v5e-512", 1, "up to 256"),
    ("v7x-8", 1, "unknown TPU generation"),
    ("v5e:2x2x2", 1, "2-D grids"),
    ("a100x8", 1, "no target description"),
    ("h100x12", 1, "whole hosts of 8"),
    ("tpu", 1, "expected a TPU slice"),
    ("v5e-4", 0, "--slices 0"),
])
def test_bad_topologies_are_refused_naming_them(name, slices, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        topology.parse(name, slices)


def test_the_platform_follows_the_mesh_and_comes_back():
    devices = tpu_devices("v5e:2x2")
    config = load_run_config("configs/tiny.yaml", TINY).model
    assert target.platform() == "cpu" and chosen_attention(config) == "chunked"
    with target.compiling_for(devices) as name:
        assert name == target.platform() == "tpu" and chosen_attention(config) == "splash"
        mesh = jax.sharding.Mesh(np.array(devices), ("x",))
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, P())), abstract_params(config))
    assert target.platform() == "cpu"
    # The decoder's choices read the parameters' devices: one device's memory is one device's
    # (a CPU's devices all draw on the host), and a TPU decodes unrolled when the copy fits.
    assert memory_need(100, params) == 100
    assert resolve_decode_impl("auto", params) == "unrolled"


@pytest.fixture(scope="module")
def tiny_run():
    return load_run_config("configs/tiny.yaml", TINY)


def dot_operand_types(lowered_text: str) -> list[str]:
    """The element types of each dot_general's operands in a StableHLO module."""
    return re.findall(r"stablehlo\.dot_general [^\n]*: \(tensor<(?:\d+x)*(\w+)>, "
                      r"tensor<(?:\d+x)*(\w+)>\)", lowered_text)


def lowered_step(run, devices) -> str:
    mesh = sharding.make_mesh(run.mesh, devices)
    with target.compiling_for(mesh), sharding.use_mesh(mesh, run.mesh):
        return jitted_programs(run, 1, mesh).lower_step().as_text()


def test_a_tpu_step_keeps_bf16_matmuls_where_the_cpu_widens_them(tiny_run):
    """The CPU's workaround (bf16 operands widened to fp32 before each matmul) must not reach
    a TPU program: every matmul of a bf16 model's TPU step keeps a bf16 operand (the
    backward pass multiplies fp32 cotangents by bf16 values), where the same step lowered for
    this host's CPU devices has none left, which is what a forgotten call site would leave.
    (Dense attention: splash's own kernel code has fp32 dots of its own.)"""
    run = dataclasses.replace(tiny_run, model=tiny_run.model.with_execution(
        attention_impl="xla"))
    cpu = dot_operand_types(lowered_step(run, jax.devices()[:4]))
    tpu_text = lowered_step(run, tpu_devices("v5e:2x2"))
    tpu = dot_operand_types(tpu_text)
    assert cpu and all(pair == ("f32", "f32") for pair in cpu), set(cpu)
    assert all("bf16" in pair for pair in tpu), set(tpu)
    # besides the CPU's matmuls, RoPE's partners by a permutation matmul ([H, H], bf16)
    H = run.model.H
    rotations = len(re.findall(rf"stablehlo\.dot_general [^\n]*, tensor<{H}x{H}xbf16>\)",
                               tpu_text))
    assert rotations > 0 and len(tpu) == len(cpu) + rotations


def test_a_tpu_step_runs_splash_as_mosaic_kernels_within_the_plan(tiny_run):
    """On a v5p slice, the pods' chip (a v5e slice's step compiles from the command line, in
    test_json_report_and_bad_topology_from_the_command_line)."""
    name = "v5p:2x2x1"
    report = compile_training(tiny_run, name)
    step, evaluation = report.programs
    assert report.platform == "tpu" and report.fits
    assert report.attention.startswith("attention: splash (auto on tpu")
    assert MOSAIC in step.custom_calls and MOSAIC in evaluation.custom_calls
    assert report.versions["libtpu"] and report.limit == topology_limit(name)
    # the state XLA was given is the planner's (the optimizer's few scalar counters aside);
    # the whole step within the bound
    assert report.parameters == report.plan.weights
    assert 0 <= report.optimizer - report.plan.optimizer < 64
    ratio = step.peak / report.plan.training
    assert PLAN_BOUND[0] <= ratio <= PLAN_BOUND[1], ratio
    text = render(report, tiny_run)
    assert "train step total" in text and "fits (" in text


def topology_limit(name: str) -> int:
    from llama_jax.plan.hardware import HARDWARE

    return HARDWARE[topology.parse(name).hardware].memory_bytes


def test_splash_forward_and_backward_compile_to_mosaic_kernels():
    devices = tpu_devices("v5e:2x2")
    B, T, N, K, H = 2, 512, 4, 2, 128
    q, k, v = (jax.ShapeDtypeStruct((B, T, heads, H), jnp.bfloat16)
               for heads in (N, K, K))
    mask = Mask.causal(B, T)

    def loss(q, k, v):
        out = dot_product_attention(q, k, v, mask, impl="splash", block_q=128, block_kv=128)
        return out.astype(jnp.float32).sum()

    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P()))
              for a in (q, k, v)]
    with target.compiling_for(mesh):
        forward = jax.jit(loss).lower(*placed).compile().as_text()
        backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*placed).compile().as_text()
    assert forward.count(f'custom_call_target="{MOSAIC}"') >= 1
    # the backward pass runs splash's own kernels (dq, dk/dv) besides the forward's
    assert backward.count(f'custom_call_target="{MOSAIC}"') >= 2


@pytest.mark.skipif(topology.cuda_plugin() is None,
                    reason="jax's CUDA plugin is not installed (pip install 'jax[cuda12]', "
                           "several GB; make test leaves it out)")
def test_a_gpu_step_runs_cudnn_attention_with_the_gpu_flags(tiny_run):
    report = compile_training(tiny_run, "h100x8")
    step = report.programs[0]
    assert report.platform == "gpu" and report.n_devices == 8 and report.fits
    assert report.attention.startswith("attention: cudnn (auto on gpu")
    assert any(call.startswith("__cudnn$fmha") for call in step.custom_calls), step
    # the library's GPU flags, as compile options: XLA's default command buffers and loops
    options = report.compiler_options
    assert options["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert {"WHILE", "CONDITIONAL", "FUSION"} <= set(
        options["xla_gpu_enable_command_buffer"].split(","))
    assert report.versions["jax-cuda12-plugin"] == jax.__version__


def test_multislice_puts_the_data_axis_across_slices(tiny_run):
    devices = tpu_devices("v5e:2x2", slices=2)
    mesh = sharding.make_mesh(tiny_run.mesh, devices)
    assert dict(mesh.shape)["data"] == 8
    slice_of = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert (slice_of[:4] == 0).all() and (slice_of[4:] == 1).all()
    with pytest.raises(ConfigError, match="multiple of 2"):
        sharding.make_mesh(load_run_config("configs/tiny.yaml", ["mesh.data=1",
                                                                 "mesh.fsdp=-1"]).mesh, devices)


def run_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_a_run_that_does_not_fit_is_reported_in_one_line():
    """A vocabulary of 32K over 4096 x 256 tokens: 400 GB of logits on one v5e chip."""
    result = run_train("--config", "configs/tiny.yaml", "--compile-only", "--topology",
                       "v5e-1", "--set", "model.vocab_size=32000", "--set",
                       "train.batch_size=4096", "--set", "model.compute_dtype=bfloat16")
    assert result.returncode == 1, result.stderr[-2000:]
    verdicts = [ln for ln in result.stdout.splitlines() if "does not fit" in ln]
    assert re.fullmatch(r"train step: compiled in [\d.]+ s; does not fit: needs [\d.,]+ GiB "
                        r"of 15\.8 GiB per chip", verdicts[0]), result.stdout
    assert "activations" in result.stdout  # the planner's breakdown beside it
    assert "Traceback" not in result.stderr


def test_json_report_and_bad_topology_from_the_command_line():
    result = run_train("--config", "configs/tiny.yaml", "--compile-only", "--topology",
                       "v5e:2x2", "--json", "--set", "train.batch_size=4")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["fits"] and report["n_devices"] == 4 and report["platform"] == "tpu"
    assert report["programs"][0]["name"] == "train step"
    bad = run_train("--config", "configs/tiny.yaml", "--compile-only", "--topology", "v9-8")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: topology 'v9-8': unknown TPU generation 'v9' (known: v4, v5p, v5e, v6e)"]
    needs = run_train("--config", "configs/tiny.yaml", "--topology", "v5e-4")
    assert needs.returncode == 2 and "--topology needs --compile-only" in needs.stderr


def test_out_of_memory_messages_are_read():
    tpu = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
           "temporaries (400.00G) exceeds available HBM (15.75G).")
    memory = out_of_memory("train step", 1.0, "XlaRuntimeError: " + tpu + "\nmore")
    assert memory.needed == 400 * 2**30 and memory.available == round(15.75 * 2**30)
    assert memory.verdict(None) == "does not fit: needs 400.0 GiB of 15.8 GiB per chip"
    other = out_of_memory("step", 1.0, "RESOURCE_EXHAUSTED: Used 120.50G of 95.74G hbm.")
    assert other.needed == round(120.5 * 2**30)
    assert custom_calls('a custom_call_target="x", custom_call_target="tpu_custom_call" '
                        'custom_call_target="x"') == ("tpu_custom_call", "x")


def test_the_planner_compiles_what_it_planned():
    result = subprocess.run(
        [sys.executable, "-m", "llama_jax.plan.info", "configs/tiny.yaml", "--topology",
         "v5e-4", "--batch", "8", "--seq", "256", "--remat", "full", "--compile", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    planned, compiled = out["training"], out["compiled"]
    assert planned["devices"] == compiled["n_devices"] == 4 and planned["hardware"] == "v5e"
    assert compiled["plan"]["training"] == planned["training_bytes"]
    assert compiled["fits"] and [p["name"] for p in compiled["programs"]] == ["train step"]
    assert planned["attention"] == "splash" and "splash" in compiled["attention"]


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_int8_decode_on_a_tpu_is_one_matmul_per_weight(platform):
    """The CPU's int8 workaround (each weight's matmul in slices of 256 rows inside a loop) must
    stay on CPUs: an unrolled decode step compiled for one v5e chip has no loop at all, where
    the same step lowered for the CPU has one per int8 weight."""
    from llama_jax.decode.generate import lower_programs
    from llama_jax.model.transformer import unstack_layers

    config = load_run_config("configs/tiny.yaml", [
        "model.dim=512", "model.n_heads=8", "model.n_kv_heads=4", "model.quantize=int8",
        "model.compute_dtype=bfloat16", "model.param_dtype=bfloat16"]).model
    device = (tpu_devices("v5e-1") if platform == "tpu" else jax.devices())[0]
    here = NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)), P())
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here),
                          jax.eval_shape(unstack_layers, abstract_params(config)))
    with target.compiling_for([device]):
        prefill, step = lower_programs(config, params, batch=2, prompt_len=16, new_tokens=16,
                                       cache_dtype="int8")
        text = step.as_text()
        prefill.compile()
    loops = text.count("stablehlo.while")
    assert (loops == 0) if platform == "tpu" else (loops >= 4 * config.L), loops


def test_compile_only_on_this_host_counts_what_xla_cpu_allocates():
    """Without a topology the run compiles for this host's devices, where XLA reports no
    meaningful peak: the total is arguments + outputs + temporaries, near the planner's."""
    run = load_run_config("configs/tiny.yaml", ["train.batch_size=8"])
    report = compile_training(run)
    step = report.programs[0]
    assert report.platform == "cpu" and report.limit is None and step.peak is None
    assert step.total == step.arguments + step.outputs + step.temporaries
    assert 0.8 < step.total / report.plan.training < 1.25


def test_int8_weights_are_dequantized_inside_their_matmuls_on_a_tpu():
    """A decode step with int8 weights, at a width whose matrices do not fit a TPU core's own
    memory (LLaMA-3 8B's, one layer), compiled for a v5e chip: no dequantized copy of a weight
    is written to HBM (a copy forced with an optimization barrier is found: 12 of them)."""
    from llama_jax.aot.decoding import compile_decoding

    config = dataclasses.replace(load_run_config("configs/llama3-8b.yaml").model, n_layers=1,
                                 vocab_size=1024)
    tpu_devices("v5e-1")
    (case,) = compile_decoding(config, "v5e-1", context=64,
                               cases=[("unrolled", "int8", "int8")])
    assert case.step.fits and case.dequantized_copies == 0
    assert 0 < case.floor_bytes < case.bytes_accessed


def test_a_server_compiled_for_a_tpu_holds_its_part_of_the_cache():
    """A tiny model's server (`aot.serving`, the engine's own programs) on v5e chips: alone on
    one chip with the scan decoder, and over data=2 x tensor=2 with the unrolled one (`auto`'s
    on TPUs).
    Each chip holds the part of the KV cache's pages (the rows' and the prefix cache's) that
    `serve`'s start-up check counts (a quarter over the mesh: pages over data, KV heads over
    tensor), and every program holds the pages (the decode program the weights too)."""
    config = load_run_config("configs/tiny.yaml", TINY).model
    tpu_devices("v5e:2x2")
    shape = dict(max_batch=8, max_seq_len=256, cache_dtype="int8")
    alone = compile_serving(config, "v5e:2x2", decode_impl="scan", **shape)
    split = compile_serving(config, "v5e:2x2", mesh=MeshConfig(data=2, tensor=2), **shape)
    assert (alone.decode_impl, split.decode_impl) == ("scan", "unrolled")
    for report in (alone, split):
        assert report.platform == "tpu" and report.fits, render_serving(report)
        assert report.cache == report.planned_cache + report.prefix_cache
        assert report.prefix_cache > 0
        prefill, insert, decode = report.programs
        assert decode.total >= report.parameters + report.cache
        assert min(prefill.total, insert.total) >= report.cache
    assert alone.cache == 4 * split.cache
    assert split.parameters < alone.parameters and split.n_devices == 4


def test_a_tpu_servers_decode_steps_read_pages_with_the_pallas_kernel():
    """A bf16 server of 128-feature heads on one v5e chip: its decode program reads the pool
    in place with Pallas's paged attention kernel (a Mosaic call, lowered for the chip);
    its prefill chunks gather. The compute dtype `auto` chose on this CPU host (float32) is
    chosen again for the TPU (bfloat16), and the cache's default dtype follows it."""
    config = load_run_config("configs/tiny.yaml", [t for t in TINY if "heads" not in t
                                                   and "compute" not in t] +
                             ["model.n_heads=2", "model.n_kv_heads=1"]).model
    assert config.H == 128 and config.compute_dtype == "float32"
    tpu_devices("v5e-1")
    report = compile_serving(config, "v5e-1", max_batch=2, max_seq_len=64)
    assert report.cache_dtype == "bfloat16" and report.fits, render_serving(report)
    calls = {p.name: p.custom_calls for p in report.programs}
    assert MOSAIC in calls["decode"] and MOSAIC not in calls["prefill"], calls


def test_a_speculating_server_compiled_for_a_tpu_holds_the_drafts_cache_too():
    """A speculating server on one v5e chip, its draft model guessing: it compiles its
    rounds that verify (`speculate`) in place of decode steps, over k + 1 more slots, and
    the draft's prefill chunk; its pages hold the draft's cache beside the model's, as the
    start-up check counts them."""
    config = load_run_config("configs/tiny.yaml", TINY).model
    draft = dataclasses.replace(config, n_layers=1)
    tpu_devices("v5e-1")
    report = compile_serving(config, "v5e-1", draft_config=draft, max_batch=4, max_seq_len=128,
                             num_speculative_tokens=3)
    names = ["prefill", "draft prefill", "insert", "speculate"]
    assert report.fits and [p.name for p in report.programs] == names, render_serving(report)
    assert report.cache_len >= 128 + 3
    assert report.cache == report.planned_cache + report.prefix_cache
    assert report.programs[-1].total >= report.parameters + report.cache
    assert "speculating (draft, k=3)" in render_serving(report)


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_a_server_that_does_not_fit_a_chip_is_reported_in_one_line(tmp_path):
    """131,072 rows of a tiny model on one v5e chip: their pages (17 GiB) are cut to the 90%
    of the chip's memory the pool takes by default, and the decode program's working memory
    beside them does not fit. The same server checked on this host from a checkpoint fits;
    --topology alone is refused."""
    big = run_module("llama_jax.aot.serving", "configs/tiny.yaml", "--topology", "v5e-1",
                     "--max-batch", "131072")
    assert big.returncode == 1, big.stderr[-2000:]
    assert re.search(r"^decode: compiled in [\d.]+ s; does not fit: needs [\d.]+ GiB of "
                     r"15\.8 GiB per chip$",
                     big.stdout, re.M), big.stdout
    assert "server: does not fit" in big.stdout and "Traceback" not in big.stderr
    checkpoint = tiny_checkpoint_with_tokenizer(tmp_path / "m")
    here = run_module("llama_jax.serve", "--checkpoint", str(checkpoint), "--compile-only",
                      "--max-batch", "4", "--draft-checkpoint", str(checkpoint))
    assert here.returncode == 0, here.stderr[-2000:]
    assert re.search(r"^server: fits: needs [\d.]+ [KM]iB of [\d.]+ GiB per device",
                     here.stdout, re.M), here.stdout
    refused = run_module("llama_jax.serve", "--checkpoint", str(checkpoint), "--topology",
                         "v5e-1")
    assert refused.returncode == 2 and "--topology needs --compile-only" in refused.stderr
