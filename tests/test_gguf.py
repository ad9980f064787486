"""GGUF checkpoints: a file written here with gguf's own writer, the way llama.cpp's converter
writes one (Q/K rows permuted for interleaved RoPE, blocks of several quantized types), loads
to the logits transformers computes from the same file; bad files are refused in one line."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

import llama_jax  # noqa: E402
from llama_jax import load_checkpoint  # noqa: E402
from llama_jax.errors import CheckpointError  # noqa: E402
from llama_jax import gguf_file  # noqa: E402
from llama_jax.data.tokenizer import save_tokenizer, tokenizer_sha256  # noqa: E402
from llama_jax.formats.checkpoint import checkpoint_config  # noqa: E402
from checkpoints import save_trained_here, stdlib_tokenizer  # noqa: E402
from reference import relative_error  # noqa: E402

# GGUF name of each HF tensor of a layer, and the type it is stored in: every block format the
# gguf package can write, besides the float ones
LAYER = {"self_attn.q_proj": ("attn_q", Q.Q4_1), "self_attn.k_proj": ("attn_k", Q.Q8_0),
         "self_attn.v_proj": ("attn_v", Q.Q5_0), "self_attn.o_proj": ("attn_output", Q.Q4_0),
         "mlp.gate_proj": ("ffn_gate", Q.Q5_1), "mlp.up_proj": ("ffn_up", Q.F16),
         "mlp.down_proj": ("ffn_down", Q.BF16), "input_layernorm": ("attn_norm", Q.F32),
         "post_attention_layernorm": ("ffn_norm", Q.F32),
         "block_sparse_moe.gate": ("ffn_gate_inp", Q.F32)}
THETA = 50000.0
TOP = {"model.embed_tokens": ("token_embd", Q.Q8_0), "model.norm": ("output_norm", Q.F32),
       "lm_head": ("output", Q.F16)}


def hf_model(tied: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=THETA),
        max_position_embeddings=256, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a swapped or missing norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: HF's half-split RoPE rows to interleaved."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def saved_state(model) -> dict[str, np.ndarray]:
    """The model's tensors under the names its checkpoints have (transformers fuses Mixtral's
    experts in memory only: save_pretrained writes them one by one)."""
    import tempfile

    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return {k: v.astype(np.float32) for k, v in load_file(f"{tmp}/model.safetensors").items()}


EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w\d)")
EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def gguf_tensors(model, types: dict[str, Q] = {}) -> dict[str, tuple[np.ndarray, Q]]:
    """What llama.cpp's converter writes for the model: each tensor renamed (LAYER, TOP), q/k
    rows permuted, a layer's experts stacked into one [E, out, in] tensor; as `types` says by
    GGUF stem (ffn_gate_exps), else LAYER's and TOP's types."""
    c = model.config
    names = {f"model.layers.{i}.{hf}": (f"blk.{i}.{g}", t)
             for i in range(c.num_hidden_layers) for hf, (g, t) in LAYER.items()}
    names.update(TOP)
    out, experts = {}, {}
    for name, w in saved_state(model).items():
        stem = name.removesuffix(".weight")
        if stem == "lm_head" and c.tie_word_embeddings:
            continue
        if match := EXPERT.fullmatch(stem):
            layer, e, which = match.groups()
            experts.setdefault(f"blk.{layer}.{EXPERTS[which]}", {})[int(e)] = w
            continue
        gguf_name, qtype = names[stem]
        if gguf_name.endswith("attn_q"):
            w = llama_cpp_permute(w, c.num_attention_heads)
        elif gguf_name.endswith("attn_k"):
            w = llama_cpp_permute(w, c.num_key_value_heads)
        out[gguf_name] = w, types.get(gguf_name.split(".")[-1], qtype)
    for gguf_name, by_expert in experts.items():
        out[gguf_name] = (np.stack([by_expert[e] for e in sorted(by_expert)]),
                          types.get(gguf_name.split(".")[-1], Q.F32))
    return out


def write_gguf(path, model, architecture: str = "llama", types: dict[str, Q] = {},
               extra: dict[str, np.ndarray] = {}) -> None:
    """The model as llama.cpp's converter writes it (`extra`: more F32 tensors by name)."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_eos_token_id(2)
    if getattr(c, "num_local_experts", None):
        writer.add_expert_count(c.num_local_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    for name, w in extra.items():
        writer.add_tensor(name, w)
    for gguf_name, (w, qtype) in gguf_tensors(model, types).items():
        writer.add_tensor(gguf_name + ".weight", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    files = {}
    for tied in (False, True):
        path = tmp_path_factory.mktemp("gguf") / f"model-{'tied' if tied else 'untied'}.gguf"
        write_gguf(path, hf_model(tied))
        files[tied] = path
    return files


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_quantized_gguf_loads_to_transformers_logits_from_the_same_file(written, tied):
    path = written[tied]
    config, params = load_checkpoint(path, "float32")
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.ffn_dim,
            config.rope_theta, config.tie_embeddings, config.eos_ids) == (
        64, 2, 4, 2, 128, 50000.0, tied, (2,))
    reference = transformers.LlamaForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokens = np.random.default_rng(1).integers(0, 96, (2, 24))
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)).logits.numpy()
    assert relative_error(np.asarray(llama_jax.forward(config, params, tokens)), expected) < 1e-5


def test_a_gguf_loads_in_bf16_and_as_int8(written):
    path = written[False]
    reference_config, reference = load_checkpoint(path, "float32")
    tokens = np.random.default_rng(2).integers(0, 96, (1, 16))
    expected = np.asarray(llama_jax.forward(reference_config, reference, tokens))
    for dtype, quantize, tolerance in (("bfloat16", None, 3e-2), ("float32", "int8", 3e-2)):
        config, params = load_checkpoint(path, dtype, quantize=quantize)
        assert config.param_dtype == dtype and config.quantize == quantize
        got = np.asarray(llama_jax.forward(config, params, tokens), np.float32)
        assert relative_error(got, expected) < tolerance, (dtype, quantize)


def test_checkpoint_config_reads_a_gguf_without_its_weights(written):
    config = checkpoint_config(written[True])
    # GGUF keeps float32 values
    assert (config.vocab_size, config.max_seq_len, config.norm_eps) == (96, 256, np.float32(1e-5))


def test_bad_gguf_files_are_refused_in_one_line_naming_the_file(written, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(written[False].read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=f"{truncated}: not a readable GGUF file"):
        load_checkpoint(truncated)
    other = tmp_path / "model.bin"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match=f"{other}: not a GGUF file"):
        load_checkpoint(other)
    for name, architecture, message in (
            ("gpt2", "gpt2", "general.architecture is 'gpt2'"),
            ("linear", "llama", "llama.rope.scaling.type is 'linear'")):
        path = tmp_path / f"{name}.gguf"
        writer = gguf.GGUFWriter(str(path), architecture)
        if name == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(CheckpointError, match=f"{path}: {message}"):
            load_checkpoint(path)


def f32_types() -> dict[str, Q]:
    """Every tensor as F32 (so the only rounding is what a test asks for)."""
    return {g: Q.F32 for g, _ in [*LAYER.values(), *TOP.values()]}


def test_a_mixtral_gguf_loads_its_stacked_experts_one_by_one(tmp_path):
    """llama.cpp keeps Mixtral's experts in one quantized [E, out, in] tensor per matrix:
    each expert's slice dequantizes to the weights transformers computes with."""
    from safetensors.numpy import load_file, save_file

    from checkpoints import enlarge_weights

    torch.manual_seed(2)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=THETA))).eval()
    enlarge_weights(model)
    types = {**f32_types(), "ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_1,
             "ffn_down_exps": Q.Q5_0}
    write_gguf(tmp_path / "moe.gguf", model, types=types)
    config, params = load_checkpoint(tmp_path / "moe.gguf", "float32")
    assert config.mlp == "moe" and (config.moe.n_experts, config.moe.top_k) == (4, 2)
    # the reference: transformers on the experts' weights as the blocks hold them
    model.save_pretrained(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    for name, w in state.items():
        if match := EXPERT.fullmatch(name.removesuffix(".weight")):
            qtype = types[EXPERTS[match[3]]]
            state[name] = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    reference = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32).eval()
    tokens = np.random.default_rng(5).integers(0, 96, (2, 24))
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)).logits.numpy()
    assert relative_error(np.asarray(llama_jax.forward(config, params, tokens)), expected) < 1e-5


def llama_cpp_rope_freqs(theta: float, head_dim: int, factor: float, low: float, high: float,
                         context: int) -> np.ndarray:
    """convert_hf_to_gguf's `rope_freqs` for a "llama3" scaling, computed as it does."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


# (factor, low_freq_factor, high_freq_factor, original context): Llama-3.1's, and one whose
# context the file does not hold (read back as 8192 with the low/high that give the same
# frequencies)
@pytest.mark.parametrize("scaling", [(8.0, 1.0, 4.0, 8192), (4.0, 2.0, 8.0, 4096)],
                         ids=["llama3.1", "other-context"])
def test_a_rope_freqs_tensor_loads_as_llama3_scaling(tmp_path, scaling):
    factor, low, high, context = scaling
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_parameters=dict(
            rope_type="llama3", rope_theta=THETA, factor=factor, low_freq_factor=low,
            high_freq_factor=high, original_max_position_embeddings=context))).eval()
    freqs = llama_cpp_rope_freqs(THETA, 64, factor, low, high, context)
    write_gguf(tmp_path / "scaled.gguf", model, types=f32_types(),
               extra={"rope_freqs.weight": freqs})
    write_gguf(tmp_path / "plain.gguf", model, types=f32_types())
    config, params = load_checkpoint(tmp_path / "scaled.gguf", "float32")
    assert config.rope_type == "llama3"
    if context == 8192:
        assert config.rope_scaling == llama_jax.config.RopeScaling(
            factor=factor, original_max_position_embeddings=context, low_freq_factor=low,
            high_freq_factor=high)
    tokens = np.random.default_rng(6).integers(0, 96, (1, 200))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    assert relative_error(np.asarray(llama_jax.forward(config, params, tokens)), expected) < 1e-5
    plain_config, plain = load_checkpoint(tmp_path / "plain.gguf", "float32")
    assert relative_error(np.asarray(llama_jax.forward(plain_config, plain, tokens)),
                          expected) > 1e-3  # the scaling is seen at these positions


def test_rope_freqs_that_no_llama3_scaling_gives_are_refused(tmp_path):
    model = hf_model()
    path = tmp_path / "odd.gguf"
    divisors = np.random.default_rng(7).uniform(1, 8, 8).astype(np.float32)
    write_gguf(path, model, extra={"rope_freqs.weight": divisors})
    with pytest.raises(CheckpointError, match=f"{path}: tensor 'rope_freqs.weight' is not a "
                                              "Llama-3.1 RoPE scaling"):
        load_checkpoint(path)


# Where each K-quant block (256 values) keeps its fp16 scale d (and dmin), by llama.cpp's
# block layouts; the other bytes (packed scales and quants) may be anything
K_QUANTS = {Q.Q2_K: (84, (80, 82)), Q.Q3_K: (110, (108,)), Q.Q4_K: (144, (0, 2)),
            Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def k_quant_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Random blocks of `qtype` for a [rows, cols] matrix, their scales small and finite."""
    size, scale_offsets = K_QUANTS[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for offset in scale_offsets:
        d = rng.uniform(1e-3, 4e-3, (rows, cols // 256)).astype(np.float16)
        blocks[..., offset:offset + 2] = d[..., None].view(np.uint8).reshape(*d.shape, 2)
    return blocks.reshape(rows, -1)


def test_k_quant_blocks_load_as_transformers_reads_them(tmp_path):
    """Q4_K_M-style files mix the K-quants; gguf cannot write them, so their blocks are random
    bytes with sane scales, read by both sides from the same file (rows of 256 values)."""
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_parameters=dict(rope_type="default", rope_theta=THETA), rms_norm_eps=1e-5,
        tie_word_embeddings=True)).eval()
    path = tmp_path / "k-quants.gguf"
    write_gguf(path, model)  # then the matrices again, as K-quant blocks
    reader = gguf.GGUFReader(path)
    rng = np.random.default_rng(0)
    kinds = dict(zip(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                      "ffn_down"], [Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.Q2_K, Q.Q4_K, Q.Q6_K]))
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        kind = kinds.get(t.name.split(".")[2]) if t.name.startswith("blk.") else None
        if kind is None:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        else:
            rows, cols = int(t.shape[1]), int(t.shape[0])
            writer.add_tensor(t.name, k_quant_blocks(rng, rows, cols, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config, params = load_checkpoint(tmp_path / "k.gguf", "float32")
    reference = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, gguf_file="k.gguf", dtype=torch.float32).eval()
    tokens = np.random.default_rng(3).integers(0, 64, (2, 16))
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)).logits.numpy()
    assert relative_error(np.asarray(llama_jax.forward(config, params, tokens)), expected) < 1e-5


@pytest.fixture(scope="module")
def tokenizer_model():
    return stdlib_tokenizer()


@pytest.fixture(scope="module")
def trained_here(tmp_path_factory, tokenizer_model):
    model, texts = tokenizer_model
    return save_trained_here(tmp_path_factory.mktemp("native") / "model", "dense", model), texts


@pytest.mark.parametrize("variant", ["moe", "llama3"])
def test_experts_and_rope_scaling_export_to_gguf_and_read_back(variant, tokenizer_model,
                                                                tmp_path):
    from llama_jax.formats.convert import convert

    source = save_trained_here(tmp_path / "model", variant, tokenizer_model[0])
    out = tmp_path / "model.gguf"
    assert convert(source, out, to="gguf", dtype="f32")["round_trip"] <= 1e-6
    config, back_config = checkpoint_config(source), checkpoint_config(out)
    assert back_config.architecture() == config.architecture()
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert ("blk.1.ffn_down_exps.weight" in names) == (variant == "moe")
    assert ("rope_freqs.weight" in names) == (variant == "llama3")


def test_a_model_trained_here_exports_to_gguf_and_reads_back(trained_here, tmp_path):
    from llama_jax.formats.convert import convert

    source, texts = trained_here
    out = tmp_path / "model.gguf"
    report = convert(source, out, to="gguf", dtype="f32")
    assert report["round_trip"] <= 1e-6 and out.is_file()
    config, params = load_checkpoint(source)
    tokens = np.random.default_rng(4).integers(0, 400, (2, 20))
    expected = np.asarray(llama_jax.forward(config, params, tokens))
    back_config, back = load_checkpoint(out)
    assert back_config.architecture() == config.architecture()
    assert relative_error(np.asarray(llama_jax.forward(back_config, back, tokens)),
                          expected) < 1e-6
    reference = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, gguf_file=out.name, dtype=torch.float32).eval()
    with torch.no_grad():  # llama.cpp's layout as transformers reads it
        assert relative_error(reference(torch.tensor(tokens)).logits.numpy(), expected) < 1e-5
    ours, theirs = llama_jax.load_tokenizer(source), llama_jax.load_tokenizer(out)
    for text in texts[:5] + ["Grüße  zwei  Leerzeichen\n\tund 12345 ünïcödé"]:
        assert theirs.encode(text) == ours.encode(text)
        assert theirs.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    assert (theirs.bos_id, theirs.eos_ids) == (ours.bos_id, ours.eos_ids)
    # kept in a workdir: the vocabulary alone (not the GGUF), read back as the same tokenizer
    save_tokenizer(theirs, tmp_path / "kept")
    kept = tmp_path / "kept" / "tokenizer.model"
    assert not gguf_file.is_gguf(kept) and kept.stat().st_size < out.stat().st_size / 4
    again = llama_jax.load_tokenizer(tmp_path / "kept")
    assert again.encode(texts[0]) == ours.encode(texts[0])
    assert tokenizer_sha256(again) == tokenizer_sha256(theirs)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_gguf_export_types_stay_within_their_rounding(trained_here, tmp_path, dtype):
    from llama_jax.formats.convert import GGUF_TOLERANCE, convert

    out = tmp_path / f"model-{dtype}.gguf"
    report = convert(trained_here[0], out, to="gguf", dtype=dtype)
    assert 0 < report["round_trip"] <= GGUF_TOLERANCE[dtype]
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert kinds == {"F32", dtype.upper()}  # vectors stay F32


def test_an_int8_checkpoint_exports_to_gguf_dequantized(trained_here, tmp_path):
    from llama_jax.formats.convert import GGUF_TOLERANCE, convert

    config, params = load_checkpoint(trained_here[0], quantize="int8")
    llama_jax.save_native(config, params, tmp_path / "int8")
    (tmp_path / "int8" / "tokenizer.model").write_bytes(
        (trained_here[0] / "tokenizer.model").read_bytes())
    assert checkpoint_config(tmp_path / "int8").quantize == "int8"
    report = convert(tmp_path / "int8", tmp_path / "int8.gguf", to="gguf", dtype="q8_0")
    assert 0 < report["round_trip"] <= GGUF_TOLERANCE["q8_0"]
    assert checkpoint_config(tmp_path / "int8.gguf").quantize is None


def test_gguf_export_refuses_what_it_cannot_write(trained_here, tmp_path):
    from llama_jax.formats.convert import convert

    existing = tmp_path / "there.gguf"
    existing.write_bytes(b"keep me")
    with pytest.raises(CheckpointError, match="already exists"):
        convert(trained_here[0], existing, to="gguf")
    assert existing.read_bytes() == b"keep me"
    with pytest.raises(CheckpointError, match="q4_k"):
        convert(trained_here[0], tmp_path / "x.gguf", to="gguf", dtype="q4_k")
    broken = tmp_path / "broken"  # a model whose tokenizer is corrupt is not written without it
    shutil.copytree(trained_here[0], broken)
    (broken / "tokenizer.model").write_bytes(b"\x00not a model")
    with pytest.raises(CheckpointError, match="tokenizer.model"):
        convert(broken, tmp_path / "x.gguf", to="gguf")
    assert not list(tmp_path.glob("*x.gguf*"))
