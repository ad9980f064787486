"""Sharding changes where data lives, nothing else: on 8 simulated CPU devices, a training step
on each mesh equals the single-device step; parameters and optimizer state are really split;
sharded decoding equals unsharded; a run saved on one mesh continues on another."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import llama_jax
from llama_jax.parallel import sharding, target
from llama_jax.training import trainer
from llama_jax.formats.checkpoint import load_checkpoint
from llama_jax.config import (DataConfig, MeshConfig, MlaConfig, ModelConfig, MoeConfig,
                              RunConfig, TrainConfig)
from llama_jax.errors import ConfigError
from reference import relative_error

MODELS = {  # K divisible by tensor=8, and MQA (K=1: the KV heads cannot be split)
    "mla": ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=8, ffn_dim=128,
                       max_seq_len=64, attention="mla", mla=MlaConfig(
                           q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                           qk_rope_head_dim=4, v_head_dim=8)),
    "gqa": ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=8,
                       ffn_dim=128, max_seq_len=64),
    "mqa": ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=8, n_kv_heads=1, head_dim=8,
                       ffn_dim=128, max_seq_len=64, tie_embeddings=True),
    # MoE over the expert axis: DeepSeek-style (sigmoid router with its bias updated outside
    # the gradient, a shared expert, a dense first layer, capacity dispatch with drops) and
    # Mixtral-style (softmax, dropless grouped matmuls).
    "moe-capacity": ModelConfig(vocab_size=512, dim=64, n_layers=3, n_heads=8, n_kv_heads=2,
                                ffn_dim=64, max_seq_len=64, mlp="moe", moe=MoeConfig(
                                    n_experts=8, top_k=2, n_shared_experts=1, router="sigmoid",
                                    first_dense_layers=1, capacity_factor=1.0,
                                    router_z_loss_weight=0.01, bias_update_rate=0.01)),
    "moe-dropless": ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=8, n_kv_heads=2,
                                ffn_dim=64, max_seq_len=64, mlp="moe",
                                moe=MoeConfig(n_experts=8, top_k=2)),
}
TRAIN = TrainConfig(seq_len=32, batch_size=8, steps=6, learning_rate=3e-3, warmup_steps=1,
                    log_every=2, eval_every=3, eval_batches=1, checkpoint_every=3)
MESHES = {
    "dp8": MeshConfig(data=8), "fsdp8": MeshConfig(data=1, fsdp=8),
    "tp8": MeshConfig(data=1, tensor=8), "fsdp4-tp2": MeshConfig(data=1, fsdp=4, tensor=2),
    "dp2-fsdp2-tp2": MeshConfig(data=2, fsdp=2, tensor=2),
    # the residual stream between blocks whole over tensor (sequence parallelism off)
    "fsdp4-tp2-no-sp": MeshConfig(data=1, fsdp=4, tensor=2,
                                  activation_rules={"residual_seq": None}),
    "ep8": MeshConfig(data=1, expert=8), "fsdp2-ep4": MeshConfig(data=1, fsdp=2, expert=4),
}
BOS = 1


def _run(model: ModelConfig, mesh: MeshConfig) -> RunConfig:
    return RunConfig(model=model, train=TRAIN, data=DataConfig(corpus="unused"), mesh=mesh)


def _programs(model, mesh_config, devices=None):
    devices = jax.devices() if devices is None else devices
    mesh = sharding.make_mesh(mesh_config, devices)
    return trainer.compile_programs(_run(model, mesh_config), BOS, mesh, evaluate=False)


def _batch(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    window = rng.integers(3, 512, (TRAIN.batch_size, TRAIN.seq_len + 1)).astype(np.int32)
    window[:, 0] = BOS
    window[rng.random(window.shape) < 0.05] = BOS
    return window


def _place(tree, abstract):
    return jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), tree, abstract)


@functools.cache
def _single_device_steps(name: str):
    """State after init and after each of two steps, on one device (the reference)."""
    single = _programs(MODELS[name], MeshConfig(data=1), jax.devices()[:1])
    state = _decisive_routers(single.init(jax.random.key(0)))
    states, losses = [jax.device_get(state)], []
    for seed in (1, 2):
        state, metrics = single.step(state, jax.device_put(_batch(seed), single.batch_sharding))
        states.append(jax.device_get(state))
        losses.append(float(metrics["loss"]))
    return states, losses


def _decisive_routers(state):
    """Router weights large enough that no top-k choice is decided by rounding noise (the
    sharded step sums in another order)."""
    groups = tuple({**g, "mlp": {**g["mlp"], "router": 30 * g["mlp"]["router"]}}
                   if "router" in g["mlp"] else g for g in state.params["groups"])
    return state.replace(params={**state.params, "groups": groups})


# MQA only differs from GQA where its single KV head meets the tensor axis; MoE where its
# experts meet the expert axis (and under FSDP x TP, for the dropless grouped matmuls).
CASES = ([("gqa", m) for m in MESHES if "ep" not in m] + [("mqa", m) for m in MESHES if "tp" in m]
         + [("moe-capacity", "ep8"), ("moe-capacity", "fsdp2-ep4"),
            ("moe-dropless", "fsdp2-ep4"), ("mla", "dp2-fsdp2-tp2")])


@pytest.mark.parametrize("model_name, mesh_name", CASES)
def test_a_sharded_step_equals_the_single_device_step(model_name, mesh_name):
    states, losses = _single_device_steps(model_name)
    sharded = _programs(MODELS[model_name], MESHES[mesh_name])
    state = _place(states[0], sharded.abstract)
    for i, seed in enumerate((1, 2)):
        batch = jax.make_array_from_process_local_data(sharded.batch_sharding, _batch(seed))
        state, metrics = sharded.step(state, batch)
        assert float(metrics["loss"]) == pytest.approx(losses[i], rel=1e-5)
        for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(states[i + 1].params)):
            assert relative_error(got, want) < 1e-5


def test_parameters_and_optimizer_state_are_really_split():
    model = MODELS["gqa"]
    total = sum(np.prod(a.shape) * 4 for a in jax.tree.leaves(llama_jax.abstract_params(model)))
    for mesh_name, ways in (("fsdp8", 8), ("tp8", 8), ("fsdp4-tp2", 8), ("dp8", 1)):
        mesh = sharding.make_mesh(MESHES[mesh_name])
        state = trainer.initializer(_run(model, MESHES[mesh_name]), mesh).init(
            jax.random.key(0))
        norms = (model.n_layers * 2 + 1) * model.dim * 4  # replicated by design
        assert sharding.bytes_per_device(state.params) <= (total - norms) / ways + norms
        mu = state.opt_state.inner_state[1][0].mu  # adamw's first moment mirrors the params
        assert sharding.bytes_per_device(mu) == sharding.bytes_per_device(state.params)
        assert jax.tree.leaves(mu)[1].sharding == jax.tree.leaves(state.params)[1].sharding


def test_tensor_parallelism_splits_the_residual_stream_by_default():
    """Sequence parallelism is on under tensor parallelism unless `residual_seq: null`: the
    stream between blocks is split over tensor along its sequence, and a full-remat step,
    which keeps that stream per layer, holds less than the same step with it whole."""
    mesh_shape = {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
    axes, shape = ("batch", "residual_seq", "embed"), (8, 32, 64)
    on, off = MESHES["fsdp4-tp2"], MESHES["fsdp4-tp2-no-sp"]
    assert sharding.spec(axes, shape, on.activation_rules, mesh_shape) == P("fsdp", "tensor", None)
    assert sharding.spec(axes, shape, off.activation_rules, mesh_shape) == P("fsdp", None, None)
    model = dataclasses.replace(MODELS["gqa"], remat="full", n_layers=4)
    temp = [_programs(model, mesh).step.memory_analysis().temp_size_in_bytes
            for mesh in (on, off)]
    assert temp[0] < temp[1]


def test_mqa_keeps_its_single_kv_head_whole_under_tensor_parallelism(caplog):
    mesh = sharding.make_mesh(MESHES["tp8"])
    with caplog.at_level("INFO", logger="llama_jax.parallel.sharding"):
        shardings = sharding.param_shardings(llama_jax.param_specs(MODELS["mqa"]), mesh,
                                             MESHES["tp8"])
    attn = shardings["groups"][0]["attn"]
    assert attn["wk"].spec == jax.sharding.PartitionSpec(None, None, None, None)
    assert attn["wq"].spec[2] == "tensor"
    assert "does not divide kv_heads=1" in caplog.text


@pytest.mark.parametrize("decode_impl", ["scan", "unrolled"])
@pytest.mark.parametrize("model_name, mesh_name", [("gqa", "tp8"), ("gqa", "dp2-fsdp2-tp2"),
                                                   ("mla", "dp2-fsdp2-tp2")])
def test_sharded_greedy_decode_equals_unsharded(model_name, mesh_name, decode_impl):
    """MLA: heads over tensor in the absorbed decode, the latent cache's rows over data x fsdp."""
    model = MODELS[model_name]
    params = llama_jax.init_params(model, jax.random.key(3))
    prompts = [list(np.random.default_rng(i).integers(3, 512, n)) for i, n in
               enumerate((5, 11, 3, 8))]
    expected = llama_jax.generate(model, params, prompts, 12, stop_tokens=[])
    mesh = sharding.make_mesh(MESHES[mesh_name])
    placed = jax.device_put(params, sharding.param_shardings(llama_jax.param_specs(model), mesh,
                                                             MESHES[mesh_name]))
    assert llama_jax.generate(model, placed, prompts, 12, stop_tokens=[],
                              decode_impl=decode_impl) == expected


def test_the_kv_cache_follows_the_cache_rules():
    """Rows over data x fsdp and KV heads over tensor (the stacked layout of accelerators)."""
    from llama_jax.model.kv_cache import init_cache

    mesh_config = MESHES["dp2-fsdp2-tp2"]
    mesh = sharding.make_mesh(mesh_config)
    with sharding.use_mesh(mesh, mesh_config):
        cache = jax.jit(lambda: init_cache(MODELS["gqa"], 4, 16, "bfloat16"))().groups[0]
        per_layer = jax.jit(lambda: init_cache(MODELS["gqa"], 4, 16,
                                               layout="per_layer"))().groups[0]
    assert cache.k.sharding.spec == jax.sharding.PartitionSpec(None, ("data", "fsdp"), "tensor")
    assert per_layer[0].k.sharding.spec[0] == ("data", "fsdp")
    assert sharding.bytes_per_device(cache.k) == cache.k.nbytes // 8


@pytest.mark.parametrize("model_name, mesh_name", [("gqa", "dp2-fsdp2-tp2"), ("gqa", "tp8"),
                                                   ("mla", "dp2-fsdp2-tp2")])
@pytest.mark.parametrize("batch", [1, 4])
def test_the_decoders_cache_reserve_is_what_a_device_holds(model_name, mesh_name, batch):
    """What "auto" reserves per device for the cache before choosing the decoder: a row or a
    KV head the mesh cannot split is held whole (one row on 8 devices: all of it on each)."""
    from llama_jax.decode.decoder import cache_bytes_per_device
    from llama_jax.model.kv_cache import init_cache

    model, mesh_config = MODELS[model_name], MESHES[mesh_name]
    mesh = sharding.make_mesh(mesh_config)
    placed = jax.device_put(
        llama_jax.init_params(model, jax.random.key(4)),
        sharding.param_shardings(llama_jax.param_specs(model), mesh, mesh_config))
    with sharding.use_mesh(mesh, mesh_config):
        cache = jax.jit(lambda: init_cache(model, batch, 24, "int8"))()
    assert cache_bytes_per_device(model, placed, batch, 24, "int8", mesh_config) == \
        sharding.bytes_per_device(cache.groups)


def test_cpu_devices_reserve_from_the_host_they_share(monkeypatch):
    """On CPU the 8 devices' copies and caches all come out of the host's free memory."""
    from llama_jax.decode import decoder

    model, mesh_config = MODELS["gqa"], MESHES["tp8"]
    mesh = sharding.make_mesh(mesh_config)
    placed = jax.device_put(
        llama_jax.init_params(model, jax.random.key(5)),
        sharding.param_shardings(llama_jax.param_specs(model), mesh, mesh_config))
    need = 8 * (sharding.bytes_per_device(placed["groups"]) + 1000)
    for free, impl in ((need, "unrolled"), (need - 1, "scan")):
        monkeypatch.setattr(decoder, "free_memory_bytes", lambda: free)
        assert decoder.resolve_decode_impl("auto", placed, reserve_bytes=1000) == impl


@pytest.mark.parametrize("backend, devices_counted", [("gpu", 1), ("cpu", 8)])
def test_the_server_checks_the_cache_a_device_holds(backend, devices_counted, monkeypatch):
    """On a mesh each accelerator holds its part of the server's cache, and is checked for
    that part alone; CPU devices all draw on the host, which must hold every part."""
    from llama_jax.model.kv_cache import init_paged_cache
    from llama_jax.serve import app

    model, mesh_config = MODELS["gqa"], MESHES["dp2-fsdp2-tp2"]
    mesh = sharding.make_mesh(mesh_config)
    placed = jax.device_put(
        llama_jax.init_params(model, jax.random.key(6)),
        sharding.param_shardings(llama_jax.param_specs(model), mesh, mesh_config))
    # 4 rows of 40 positions in pages of 16: 12 pages, the pool a multiple of the 8 devices
    with sharding.use_mesh(mesh, mesh_config):
        cache = jax.jit(lambda: init_paged_cache(model, 16, 16, jnp.zeros((4, 3), jnp.int32),
                                                 "bfloat16"))()
    need = devices_counted * sharding.bytes_per_device(cache.groups)
    # the parameters' devices are of that platform (parallel/target.py)
    monkeypatch.setattr(target, "platform_of_tree", lambda tree: backend)
    check = functools.partial(app.check_cache_fits, model, placed, "bfloat16", mesh_config,
                              max_batch=4, max_seq_len=40)
    monkeypatch.setattr(app, "free_memory_bytes", lambda: need)
    check()
    monkeypatch.setattr(app, "free_memory_bytes", lambda: need - 1)
    part = "each device's part of the KV cache" if backend == "gpu" else "the KV cache"
    with pytest.raises(llama_jax.GenerateError, match=f"^{part} of --max-batch 4 rows"):
        check()


def test_a_run_saved_on_one_mesh_continues_on_another(corpus_dir, tmp_path):
    model = MODELS["gqa"]
    data = DataConfig(corpus=str(corpus_dir))
    quiet = functools.partial(trainer.train, log=lambda _: None, progress=False)
    # The straight run and the first half share a mesh, and so their compiled programs.
    straight = RunConfig(model=model, train=TRAIN, data=data, mesh=MESHES["fsdp8"])
    quiet(straight, tmp_path / "straight")
    quiet(straight, tmp_path / "moved", stop_at=3)
    quiet(dataclasses.replace(straight, mesh=MESHES["fsdp4-tp2"]), tmp_path / "moved")
    (_, a), (_, b) = load_checkpoint(tmp_path / "moved"), load_checkpoint(tmp_path / "straight")
    for got, want in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert relative_error(got, want) < 1e-4


@pytest.mark.parametrize("mesh, match", [
    (MeshConfig(data=3), r"mesh \{'data': 3, 'fsdp': 1, 'tensor': 1, 'expert': 1\} has 3 "
                         r"devices; this run has 8"),
    (MeshConfig(data=-1, fsdp=3), "do not divide the 8 devices"),
    (MeshConfig(data=1, fsdp=8), None),  # batch 8 over 8 shards: fine
])
def test_mesh_sizes_are_checked(mesh, match):
    if match is None:
        assert mesh.shape_for(8) == (1, 8, 1, 1)
        return
    with pytest.raises(ConfigError, match=match):
        sharding.make_mesh(mesh)


def test_batch_must_split_over_the_batch_shards(corpus_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "compile_programs", lambda *a: pytest.fail("compiled"))
    run = RunConfig(model=MODELS["gqa"], train=dataclasses.replace(TRAIN, batch_size=12),
                    data=DataConfig(corpus=str(corpus_dir)), mesh=MeshConfig(data=8))
    with pytest.raises(ConfigError, match="12 sequences per micro-batch do not split across "
                                          "the 8 batch shards"):
        trainer.train(run, tmp_path, log=lambda _: None, progress=False)


def test_unknown_axis_names_in_rules_are_refused():
    with pytest.raises(ConfigError, match="'embd' is not a logical axis name"):
        MeshConfig(weight_rules={"embd": "fsdp"})
    with pytest.raises(ConfigError, match="activation_rules.batch='model' must be a mesh axis"):
        MeshConfig(activation_rules={"batch": "model"})


def test_sharded_decoding_compiles_under_the_given_mesh_rules():
    """The user's rules (batch rows over data only, not data x fsdp) reach the compiled
    decoder."""
    from llama_jax.decode import generate as decoder

    model = MODELS["gqa"]
    rules = MeshConfig(data=2, fsdp=2, tensor=2, activation_rules={"batch": "data"},
                       cache_rules={"batch": "data"})
    mesh = sharding.make_mesh(rules)
    params = jax.device_put(llama_jax.init_params(model, jax.random.key(3)),
                            sharding.param_shardings(llama_jax.param_specs(model), mesh, rules))
    prompts = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]]  # 4 rows: data x fsdp divides them
    expected = llama_jax.generate(model, params, prompts, 4, stop_tokens=[], decode_impl="scan")
    decoder._EXECUTABLES.clear()
    assert llama_jax.generate(model, params, prompts, 4, stop_tokens=[], decode_impl="scan",
                              mesh_config=rules) == expected
    (key, prefill), = [(k, e) for k, e in decoder._EXECUTABLES.items()
                       if k[0] is decoder._prefill]
    assert dict(key[1])["placement"][1] == rules
    cache_k = prefill.output_shardings.rows.cache.groups[0].k
    assert cache_k.spec[1] == "data"  # the default rules split rows over ("data", "fsdp")
