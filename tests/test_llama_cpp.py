"""llama.cpp itself (llama-cpp-python, built by `make llama-cpp`; in `make test-real`) runs the
GGUF files this library writes: its logits equal ours within the written type's rounding, its
tokenizer gives our ids, and on a real model (SmolLM2-135M-Instruct re-exported) its greedy
tokens are ours. Dense, Mixtral-style and Llama-3.1-scaled models, so the file's expert and
rope_freqs conventions are checked by their reader, not only by ours."""

from __future__ import annotations

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="make llama-cpp builds llama-cpp-python")
pytest.importorskip("gguf")

import llama_jax  # noqa: E402
from checkpoints import save_trained_here, smollm2_gguf, stdlib_tokenizer  # noqa: E402
from llama_jax.formats.convert import GGUF_TOLERANCE, convert  # noqa: E402
from reference import relative_error  # noqa: E402

pytestmark = pytest.mark.real
GGML_F32 = 0  # llama.cpp's type id: a float32 KV cache, so f32 files compare at float32


def llama_cpp_model(path, n_ctx: int):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, logits_all=True,
                           type_k=GGML_F32, type_v=GGML_F32, verbose=False)


def llama_cpp_logits(model, ids: list[int]) -> np.ndarray:
    model.reset()
    model.eval(ids)
    return np.array(model.scores[:len(ids)], np.float64)


@pytest.fixture(scope="module")
def tokenizer_model():
    return stdlib_tokenizer()


@pytest.mark.parametrize("variant", ["dense", "moe", "llama3"])
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_llama_cpp_runs_our_gguf_exports_to_our_logits(variant, dtype, tokenizer_model,
                                                       tmp_path):
    model, texts = tokenizer_model
    source = save_trained_here(tmp_path / "model", variant, model)
    out = tmp_path / "model.gguf"
    convert(source, out, to="gguf", dtype=dtype)
    config, params = llama_jax.load_checkpoint(source, "float32")
    tokenizer = llama_jax.load_tokenizer(source)
    theirs = llama_cpp_model(out, 2048)
    for text in texts[:3]:
        ids = tokenizer.encode(text[:400])  # with BOS, as llama.cpp's
        assert theirs.tokenize(text[:400].encode()) == ids
        expected = np.asarray(llama_jax.forward(config, params, np.array([ids])), np.float64)[0]
        err = relative_error(llama_cpp_logits(theirs, ids), expected)
        assert err <= GGUF_TOLERANCE[dtype] * (10 if dtype == "f32" else 1), err


@pytest.fixture(scope="module")
def smollm2_export(tmp_path_factory):
    source = smollm2_gguf()
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-f32.gguf"
    convert(source, out, to="gguf", dtype="f32")
    return source, out


def test_llama_cpp_on_our_smollm2_export_gives_our_logits_and_greedy_tokens(smollm2_export):
    from llama_jax.data.chat import chat_format

    source, out = smollm2_export
    config, params = llama_jax.load_checkpoint(source, "float32")
    tokenizer = llama_jax.load_tokenizer(source)
    prompt = chat_format(source, tokenizer)(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper."}])
    theirs = llama_cpp_model(out, 512)
    expected = np.asarray(llama_jax.forward(config, params, np.array([prompt])), np.float64)[0]
    assert relative_error(llama_cpp_logits(theirs, prompt), expected) < 1e-5
    ours = llama_jax.generate(config, params, [prompt], 40, stop_tokens=[])[0]
    theirs.reset()
    greedy = []
    for token in theirs.generate(prompt, temp=0.0, top_k=1, reset=True):
        greedy.append(token)
        if len(greedy) == 40:
            break
    assert greedy == list(ours)
