"""The planner: parameter counts of every preset (the published sizes, to the unit), KV-cache
bytes, FLOPs formula, and the CLI."""

import json

import pytest

from llama_jax.plan import costs, info
from llama_jax.config import load_model_config

# preset: (D, L, N, K, F, V, params) — the published sizes.
PUBLISHED = {
    "llama1-7b": (4096, 32, 32, 32, 11008, 32000, 6_738_415_616),
    "llama2-7b": (4096, 32, 32, 32, 11008, 32000, 6_738_415_616),
    "llama1-13b": (5120, 40, 40, 40, 13824, 32000, 13_015_864_320),
    "llama2-13b": (5120, 40, 40, 40, 13824, 32000, 13_015_864_320),
    "llama1-33b": (6656, 60, 52, 52, 17920, 32000, 32_528_943_616),
    "llama1-65b": (8192, 80, 64, 64, 22016, 32000, 65_285_660_672),
    "llama2-70b": (8192, 80, 64, 8, 28672, 32000, 68_976_648_192),
    "llama3-8b": (4096, 32, 32, 8, 14336, 128256, 8_030_261_248),
    "llama3.1-8b": (4096, 32, 32, 8, 14336, 128256, 8_030_261_248),
    "llama3-70b": (8192, 80, 64, 8, 28672, 128256, 70_553_706_496),
    "llama3.1-70b": (8192, 80, 64, 8, 28672, 128256, 70_553_706_496),
    "llama3.1-405b": (16384, 126, 128, 8, 53248, 128256, 405_853_388_800),
    "llama3.2-1b": (2048, 16, 32, 8, 8192, 128256, 1_235_814_400),
    "llama3.2-3b": (3072, 28, 24, 8, 8192, 128256, 3_212_749_824),
}
CONTEXT = {"llama1": 2048, "llama2": 4096, "llama3": 8192, "llama3.1": 131072, "llama3.2": 131072}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_sizes_and_parameter_counts(preset):
    D, L, N, K, F, V, n_params = PUBLISHED[preset]
    c = load_model_config(preset)
    assert (c.D, c.L, c.N, c.K, c.F, c.V) == (D, L, N, K, F, V)
    assert c.max_seq_len == CONTEXT[preset.split("-")[0]]
    assert c.tie_embeddings == preset.startswith("llama3.2")
    assert costs.param_counts(c).total == n_params


def test_kv_cache_bytes_per_token():
    # LLaMA-2 7B bf16: 512 KiB per token; LLaMA-3 8B: 128 KiB (GQA, K = 8).
    assert costs.kv_cache_bytes_per_token(load_model_config("llama2-7b")) == 512 * 1024
    assert costs.kv_cache_bytes_per_token(load_model_config("llama3-8b")) == 128 * 1024
    assert costs.kv_cache_bytes_per_token(load_model_config("llama3-8b"), "float32") == 256 * 1024
    # MLA: DeepSeek-V2-Lite caches 512 + 64 = 576 values per layer (MHA: 16 x (192 + 128))
    assert costs.kv_cache_bytes_per_token(load_model_config("deepseek-v2-lite")) == 27 * 576 * 2


def test_mla_info_prints_the_latent_cache_beside_mha_and_mqa(capsys):
    assert info.main(["configs/mla-demo.yaml", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # 6 layers x (48 + 16) bf16 values; MHA with 4 heads of 64 + 64 would cache 8x that
    assert out["kv_cache_bytes_per_token"] == 6 * 64 * 2
    assert out["kv_cache_mha_bytes_per_token"] == 6 * 4 * 128 * 2 == 8 * 6 * 64 * 2
    assert out["config"]["mla"] == {"Z": 48, "I": 16, "J": 48, "Y": 64, "Q": None}
    assert info.main(["configs/mla-demo.yaml"]) == 0
    assert "L*(Z+I)*bytes" in capsys.readouterr().out


def test_train_flops_follow_the_stated_formula():
    c = load_model_config("llama2-7b")
    counts = costs.param_counts(c)
    # P_mm: all matmul weights and the LM head, not the input embedding and norm gains.
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008
    assert counts.matmul == 32 * per_layer + 32000 * 4096
    assert costs.train_flops_per_token(c, 2048) == 6 * counts.matmul + 6 * 32 * 2048 * 4096
    tied = costs.param_counts(load_model_config("llama3.2-1b"))
    norms = (2 * 16 + 1) * 2048
    assert tied.lm_head == 0 and tied.matmul == tied.total - tied.embedding - norms + (
        128256 * 2048)


def test_decode_floor_for_llama3_8b_on_h100():
    # 8B bf16 at 2K context, batch 1, 3.35 TB/s: weights ~15 GB (embedding table gathered, not
    # read) + 256 MiB of KV -> ~4.6 ms per token (the often quoted 4.9 ms counts the whole table).
    p = info.plan(load_model_config("llama3-8b"), batch=1, seq=2048, dtype="bfloat16",
                  bandwidth_gbps=3350)
    assert p["kv_cache_bytes"] == 2048 * 128 * 1024
    assert p["decode_floor_s_per_step"] == pytest.approx(4.56e-3, rel=0.01)


def test_cli_json(capsys):
    assert info.main(["llama3-8b", "--batch", "4", "--seq", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_params"] == 8_030_261_248
    assert out["kv_cache_bytes_per_token"] == 131072
    assert out["kv_cache_bytes"] == 131072 * 4 * 1024
    assert out["n_params_embedding"] + out["n_params_lm_head"] + out[
        "n_params_non_embedding"] == out["n_params"]


def test_cli_serving_cache(capsys):
    """--max-batch rows of --max-seq-len tokens (the engine's own cache at its largest:
    test_serve_engine.py)."""
    argv = ["llama3-8b", "--max-batch", "16", "--max-seq-len", "8192"]
    assert info.main([*argv, "--json"]) == 0
    serving = json.loads(capsys.readouterr().out)["serving"]
    assert serving["kv_cache_bytes"] == 16 * 8192 * 131072
    # At most 4x the rows' cache, in whole blocks of 128 tokens' KV (16 MiB each here).
    block = 128 * 131072
    assert serving["prefix_cache_bytes"] == 4 * serving["kv_cache_bytes"] // block * block
    assert info.main([*argv, "--cache-dtype", "int8"]) == 0
    assert "serving KV cache     8.2 GiB (int8) for 16 rows of 8192 tokens" in \
        capsys.readouterr().out


def test_cli_text_and_config_file(tmp_path, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text("base: llama3.2-1b\nmodel: {n_layers: 8}\n")
    assert info.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "6*P_mm" in out and "2*L*K*H*bytes" in out


@pytest.mark.parametrize("argv, message", [
    (["llama9-1t"], "neither a file nor a preset"),
    (["llama3-8b", "--batch", "0"], "--batch=0 must be > 0"),
    (["llama3-8b", "--max-batch", "0"], "max_batch=0 (--max-batch) and steps_per_dispatch=4 "
                                        "(--steps-per-dispatch) must be >= 1"),
    (["llama3-8b", "--max-seq-len", "0"], "max_seq_len=0 (--max-seq-len) must be in [1, 8192]"),
    (["llama3-8b", "--max-seq-len", "9000"], "max_seq_len=9000 (--max-seq-len) must be in "
                                             "[1, 8192] (the model's context)"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert info.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_the_hardware_sets_the_decode_bandwidth(capsys):
    assert info.main(["llama3-8b", "--seq", "2048", "--hardware", "v5p", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bandwidth_gbps"] == 2765  # v5p HBM, not the H100 default
    assert out["decode_floor_s_per_step"] == pytest.approx(
        out["decode_bytes_per_step"] / 2765e9)
    assert info.main(["llama3-8b", "--hardware", "v5p", "--bandwidth", "1000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bandwidth_gbps"] == 1000  # explicit wins


def test_moe_reports_total_and_active_parameters(capsys):
    """The MoE demo: 8 experts of 384, top-2, equal active parameters to the dense demo (up to
    the router), four times its MLP weights; FLOPs count what a token uses."""
    from llama_jax.config import load_model_config

    dense, moe = load_model_config("demo"), load_model_config("configs/moe-demo.yaml")
    d, m = costs.param_counts(dense), costs.param_counts(moe)
    router = moe.L * moe.D * moe.moe.n_experts
    expert_weights = moe.L * moe.moe.n_experts * 3 * moe.D * moe.expert_ffn_dim
    assert m.total == d.total - dense.L * 3 * dense.D * dense.F + expert_weights + router
    assert m.active == d.active + router == d.total + router
    assert m.matmul == d.matmul + router
    assert costs.train_flops_per_token(moe, 256) - costs.train_flops_per_token(dense, 256) \
        == 6 * router
    assert info.main(["configs/moe-demo.yaml", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["n_params"], out["n_params_active"]) == (m.total, m.active)
    assert info.main(["transformer"]) == 0  # no RoPE: no rope fields to print
    assert "positions=sinusoidal" in capsys.readouterr().out


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_moe_decode_reads_the_experts_a_batch_is_expected_to_hit(batch):
    """Each of B tokens picks top_k of E experts: a fraction 1 - (1 - k/E)^B of every expert
    tensor is read per step (k/E at B = 1; nearly all at large B); the rest as a dense model."""
    from llama_jax.config import load_model_config

    moe = load_model_config("configs/moe-demo.yaml")
    experts = moe.L * moe.moe.n_experts * 3 * moe.D * moe.expert_ffn_dim
    everything = costs.param_counts(moe).total - (costs.param_counts(moe).embedding
                                                 - batch * moe.D)
    hit = 1 - (1 - moe.moe.top_k / moe.moe.n_experts) ** batch
    expected = round(everything - experts * (1 - hit)) * 2
    assert costs.decode_bytes_per_step(moe, batch, 0, "bfloat16") == expected
