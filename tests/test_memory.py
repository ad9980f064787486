"""The planner's per-device training memory against XLA's own accounting of the compiled step
(`memory_analysis()` on 8 simulated CPU devices), and the planner CLI's training plan."""

import dataclasses
import json

import pytest

from llama_jax.nn.heads import LOSS_RUN
from llama_jax.plan import costs, info, memory
from llama_jax.parallel import sharding
from llama_jax.training import trainer
from llama_jax.config import (DataConfig, MeshConfig, MlaConfig, ModelConfig, MoeConfig,
                              RunConfig, TrainConfig, load_model_config)

MODEL = ModelConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768,
                    max_seq_len=256)
# The same active parameters with 8 experts, top-2: capacity buffers, or dropless
MOE = dataclasses.replace(MODEL, mlp="moe", ffn_dim=384, moe=MoeConfig(capacity_factor=1.25))
DROPLESS = dataclasses.replace(MOE, moe=MoeConfig(), moe_dispatch="dropless")
MLA = dataclasses.replace(MODEL, attention="mla", n_kv_heads=None, head_dim=None, mla=MlaConfig(
    q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32))
# A vocabulary whose logits outweigh the blocks, taken 32 positions at a time
BIG_VOCAB = dataclasses.replace(MODEL, vocab_size=16384, loss_chunk=32)
TRAIN = TrainConfig(seq_len=256, batch_size=16)


@pytest.mark.parametrize("mesh, remat, attention, base", [
    (MeshConfig(data=8), "none", "xla", MODEL),
    (MeshConfig(data=1, fsdp=8), "dots", "xla", MODEL),
    (MeshConfig(data=1, fsdp=4, tensor=2), "dots_no_batch", "xla", MODEL),
    (MeshConfig(data=2, fsdp=4), "full", "xla", MODEL),
    # blocks of 64 make the step really blockwise at T = 256
    (MeshConfig(data=8), "none", "chunked", MODEL),
    (MeshConfig(data=1, fsdp=4, tensor=2), "dots", "chunked", MODEL),
    (MeshConfig(data=2, expert=4), "none", "chunked", MOE),
    (MeshConfig(data=1, fsdp=2, expert=4), "none", "chunked", DROPLESS),
    (MeshConfig(data=2, fsdp=2, tensor=2), "none", "chunked", MLA),
    (MeshConfig(data=8), "dots", "xla", MLA),
    (MeshConfig(data=1, fsdp=8), "full", "chunked", BIG_VOCAB),
    (MeshConfig(data=8), "attention", "chunked", MODEL),
    (MeshConfig(data=2, fsdp=2, tensor=2), "dots_with_attention", "chunked", MODEL),
    (MeshConfig(data=1, fsdp=8), "attention", "chunked", MLA),
])
def test_planned_memory_agrees_with_the_compiled_step(mesh, remat, attention, base):
    _check_plan(mesh, remat, attention, base, TRAIN)


def test_a_bf16_first_moment_is_planned_as_stored():
    _check_plan(MeshConfig(data=1, fsdp=8), "full", "chunked", MODEL,
                dataclasses.replace(TRAIN, mu_dtype="bfloat16"))


def _check_plan(mesh, remat, attention, base, train):
    model = dataclasses.replace(base, remat=remat, attention_impl=attention,
                                attention_block_q=64, attention_block_kv=64)
    run = RunConfig(model=model, train=train, data=DataConfig(corpus="unused"), mesh=mesh)
    compiled = trainer.compile_programs(run, 1, sharding.make_mesh(mesh), evaluate=False).step
    measured = compiled.memory_analysis()
    plan = memory.plan_memory(model, mesh, 8, batch=train.batch_size, seq=train.seq_len,
                              remat=remat, mu_dtype=train.mu_dtype)
    # Arguments: the state, exactly, plus this device's rows of the batch and a few scalars.
    assert 0 <= measured.argument_size_in_bytes - (plan.weights + plan.optimizer) < 16 << 10
    ratio = (measured.argument_size_in_bytes + measured.temp_size_in_bytes) / plan.training
    assert 0.8 < ratio < 1.25, ratio  # measured 0.83-1.17 over these cases


def test_the_mla_cache_is_split_over_rows_not_over_tensor():
    """MLA's latent cache has no KV heads to split: rows over data x fsdp, replicated over
    tensor (the cache rules)."""
    plan = memory.plan_memory(MLA, MeshConfig(data=2, fsdp=2, tensor=2), 8, batch=16, seq=256,
                              remat="none", kv_batch=4, kv_seq=1024)
    assert plan.kv_cache == costs.kv_cache_bytes_per_token(MLA) * 4 * 1024 // 4


def test_planner_cli_prints_a_training_plan(capsys):
    assert info.main(["llama3-8b", "--batch", "8", "--seq", "8192", "--mesh",
                      "data=1,fsdp=8,tensor=1", "--hardware", "h100", "--remat", "full"]) == 0
    out = capsys.readouterr().out
    assert "mesh data=1,fsdp=8,tensor=1,expert=1 (8 x h100" in out and "fits in 80.0 GiB" in out
    plan = info.plan_training(load_model_config("llama3-70b"), MeshConfig(data=1, fsdp=8),
                              batch=8, seq=4096, remat="full", compute_dtype="bfloat16",
                              device=info.hardware.HARDWARE["h100"], mfu=0.4,
                              kv_dtype="bfloat16")
    assert not plan["fits"]  # fp32 AdamW state of 70B alone needs ~130 GiB per H100 at 8 ways
    assert plan["optimizer_bytes"] == 2 * plan["weights_bytes"]


def test_a_tensor_parallel_plan_says_what_sequence_parallelism_would_hold(capsys, tmp_path):
    """By default the residual stream's sequence is split over tensor between blocks. With
    that turned off, every device of a tensor group holds its rows' stream whole: LLaMA-3 70B
    at 8K tokens a device over tensor=8 plans 89.6 GiB. Such a plan also gives the same run
    with the stream split (the planner's own figure for the default rules), and says so only
    where the rules do not split it already and tensor parallelism is on."""
    config = tmp_path / "no_sp.yaml"
    config.write_text("base: llama3-70b\nmesh: {activation_rules: {residual_seq: null}}\n")
    args = ["--batch", "512", "--seq", "8192", "--hardware", "v5p", "--remat", "full",
            "--mesh", "data=1,fsdp=64,tensor=8"]
    assert info.main([str(config), *args]) == 0
    assert "with sequence parallelism (mesh.activation_rules: {residual_seq: tensor})" in \
        capsys.readouterr().out
    assert info.main(["llama3-70b", *args]) == 0
    assert "with sequence parallelism" not in capsys.readouterr().out
    kwargs = dict(batch=512, seq=8192, remat="full", compute_dtype="bfloat16",
                  device=info.hardware.HARDWARE["v5p"], mfu=0.4, kv_dtype="bfloat16")
    model = load_model_config("llama3-70b")
    whole = info.plan_training(model, MeshConfig(data=1, fsdp=64, tensor=8,
                                                 activation_rules={"residual_seq": None}),
                               **kwargs)
    split = info.plan_training(model, MeshConfig(data=1, fsdp=64, tensor=8), **kwargs)
    assert whole["sequence_parallel_training_bytes"] == split["training_bytes"]
    assert split["training_bytes"] < whole["training_bytes"] / 4
    assert split["sequence_parallel_training_bytes"] is None
    fsdp = info.plan_training(model, MeshConfig(data=1, fsdp=512), **kwargs)
    assert fsdp["sequence_parallel_training_bytes"] is None


def test_the_plan_counts_the_logits_of_one_piece_under_loss_chunk(capsys):
    """LLaMA-3-8B at 8K tokens on a GPU: the dense loss keeps the bf16 log-softmax and the
    logits' bf16 gradient, 2·2·V bytes a position, one run's fp32 logits, 4·V for each of
    LOSS_RUN positions, and the head's bf16 weight and fp32 gradient; with 1K positions at a
    time, those positions' fp32 logits and their two companions, 12·V a position, and the
    head's gradient."""
    args = ["llama3-8b", "--batch", "1", "--seq", "8192", "--hardware", "h100", "--json"]
    plans = []
    for extra in ([], ["--loss-chunk", "1024"]):
        assert info.main([*args, *extra]) == 0
        plans.append(json.loads(capsys.readouterr().out)["training"])
    V, D = 128256, 4096
    saved = plans[0]["activations_bytes"] - plans[1]["activations_bytes"]
    assert saved == (8192 * 2 * 2 + LOSS_RUN * 4 - 1024 * 12) * V + (2 + 4 - 4) * D * V


def test_the_cli_plans_a_bf16_first_moment(capsys):
    args = ["llama3-8b", "--seq", "8192", "--hardware", "h200", "--remat", "full", "--json"]
    plans = []
    for extra in ([], ["--mu-dtype", "bfloat16"]):
        assert info.main([*args, *extra]) == 0
        plans.append(json.loads(capsys.readouterr().out)["training"])
    fp32, bf16 = plans
    assert bf16["optimizer_bytes"] == 3 * fp32["optimizer_bytes"] // 4
    assert bf16["training_bytes"] == fp32["training_bytes"] - fp32["optimizer_bytes"] // 4
    assert bf16["mu_dtype"] == "bfloat16"


@pytest.mark.parametrize("argv, match", [
    (["--mesh", "data=2,model=4"], "expected data=D,fsdp=F,tensor=T"),
    (["--mesh", "data=-1,fsdp=8"], "give every size"),
    (["--mesh", "data=3", "--batch", "8"], "does not split over data x fsdp x expert = 3"),
    (["--mfu", "1.5", "--hardware", "v5p"], "must be in"),
    (["--loss-chunk", "0", "--hardware", "h100"], "--loss-chunk=0 must be > 0"),
])
def test_planner_refuses_bad_plans(argv, match, capsys):
    assert info.main(["llama3-8b", *argv]) == 2
    assert match in capsys.readouterr().err


def test_the_plan_follows_the_attention_implementation(capsys):
    """At 32K tokens per sequence the dense path's scores do not fit an H100; cuDNN's (auto on
    a GPU) and chunked attention do."""
    args = ["llama3.1-8b", "--batch", "8", "--seq", "32768", "--mesh", "data=1,fsdp=8,tensor=1",
            "--hardware", "h100", "--remat", "full"]
    plans = {}
    for impl in ("auto", "chunked", "xla"):
        assert info.main([*args, "--attention-impl", impl, "--json"]) == 0
        plans[impl] = json.loads(capsys.readouterr().out)["training"]
    assert plans["auto"]["attention"] == "cudnn" and plans["auto"]["fits"]
    assert plans["chunked"]["fits"] and not plans["xla"]["fits"]
    assert plans["xla"]["activations_bytes"] > 4 * plans["chunked"]["activations_bytes"]
    assert info.main([*args, "--attention-impl", "splash"]) == 2
    assert "attention_impl='splash' needs a TPU; the backend is 'gpu'" in (
        capsys.readouterr().err)
