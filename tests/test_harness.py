"""The lm-eval adapter on a tiny native checkpoint (llama_jax's own SentencePiece tokenizer),
offline: a local multiple-choice task through `lm_eval.simple_evaluate` and through the command
line equals scoring by hand; rolling log-likelihood equals lm-eval's windows scored by the
float64 reference; generation equals llama_jax's greedy decoding cut at a stop string.
tests/test_lm_eval_parity.py compares the adapter with lm-eval's own transformers model."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import lm_eval  # the dev extra installs it
import numpy as np
import pytest
import yaml
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import llama_jax
import reference
from llama_jax.decode import decoder
from llama_jax.decode.generate import generate
from llama_jax.data.tokenizer import train_sentencepiece
from llama_jax.eval import harness
from llama_jax.eval.harness import LlamaJaxLM
from llama_jax.eval.scoring import score

REPO = Path(__file__).resolve().parent.parent
TASK_DIR = REPO / "tests" / "lm_eval_task"
TASK = "llama_jax_tiny_mc"
TEXT = ["The cat sat on the mat and looked at the dog.",
        "A dog is a good friend; a cat is a proud one.", "Numbers: 12 34 56 78 90.",
        "The cat and the dog are friends. Twelve plus one is thirteen.",
        "Cats and dogs sat on a mat next to the proud cat."] * 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("harness")
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.model").write_bytes(train_sentencepiece(TEXT, 300))
    tokenizer = llama_jax.load_tokenizer(root / "tok")
    config = dataclasses.replace(llama_jax.load_model_config("tiny"), vocab_size=300,
                                 max_seq_len=64, init_std=0.2, eos_ids=tokenizer.eos_ids)
    llama_jax.save_native(config, llama_jax.init_params(config, jax.random.key(0)), root / "m")
    (root / "m" / "tokenizer.model").write_bytes((root / "tok" / "tokenizer.model").read_bytes())
    return root / "m"


@pytest.fixture(scope="module")
def model(checkpoint):
    config, params = llama_jax.load_checkpoint(checkpoint)
    return config, params, llama_jax.load_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The task with an absolute data path (lm-eval resolves a relative one against the
    working directory) and a datasets cache of its own."""
    root = tmp_path_factory.mktemp("task")
    task = yaml.safe_load((TASK_DIR / "tiny_mc.yaml").read_text())
    task["dataset_kwargs"] = {"data_files": {"test": str(TASK_DIR / "tiny_mc.jsonl")},
                              "cache_dir": str(root / "datasets")}
    (root / "tiny_mc.yaml").write_text(yaml.safe_dump(task))
    return root


@pytest.fixture(scope="module")
def evaluation(checkpoint, task_dir):
    return lm_eval.simple_evaluate(
        model="llama_jax", model_args=f"checkpoint={checkpoint},batch_size=4", tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True)


def test_registering_llama_jax_keeps_the_built_in_models():
    from lm_eval.api.registry import get_model

    assert get_model("llama_jax") is LlamaJaxLM
    assert get_model("dummy").__name__ == "DummyLM"


def test_multiple_choice_equals_scoring_by_hand(evaluation, model):
    """Per document: the logged log-likelihood of each choice is `score` on the context with
    BOS and the tokens that " choice" adds to it; acc is whether the best is the gold one."""
    config, params, tokenizer = model
    docs = [json.loads(line) for line in (TASK_DIR / "tiny_mc.jsonl").read_text().splitlines()]
    samples = sorted(evaluation["samples"][TASK], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(docs)))
    accs = []
    for doc, sample in zip(docs, samples):
        context = tokenizer.encode(doc["question"])
        continuations = [tokenizer.encode(f"{doc['question']} {choice}")[len(context):]
                         for choice in doc["choices"]]
        scores = score(config, params, [context] * len(continuations), continuations)
        logged = [logprob for logprob, _ in sample["filtered_resps"]]
        np.testing.assert_allclose(logged, [s.logprob for s in scores], atol=1e-5)
        accs.append(float(np.argmax([s.logprob for s in scores]) == doc["label"]))
        assert sample["acc"] == accs[-1]
    assert evaluation["results"][TASK]["acc,none"] == pytest.approx(np.mean(accs))
    assert 0 < np.mean(accs) < 1  # an untrained model: both outcomes occur


def test_max_length_rolling_windows_and_truncation(checkpoint, model):
    """With max_length 16: rolling log-likelihood is lm-eval's windows of 16 predictions over
    the text encoded with BOS (the first window after a BOS prefix, the last with a full
    context), each scored by the float64 reference; a longer loglikelihood request keeps the
    last 16 tokens it reads."""
    config, params, tokenizer = model
    lm = LlamaJaxLM(checkpoint=str(checkpoint), max_length="16", batch_size="3")
    texts = [" ".join(TEXT[:4]), TEXT[2]]
    expected = []
    for text in texts:
        tokens = tokenizer.encode(text)
        total = 0.0
        for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                tokens, tokenizer.bos_id, max_seq_len=16, context_len=1)):
            sequence = np.array([context + continuation])
            logits = reference.forward(config, params, sequence)[0]
            shifted = logits - logits.max(-1, keepdims=True)
            logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
            rows = np.arange(len(context) - 1, len(context) + len(continuation) - 1)
            total += logprobs[rows, continuation].sum()
        expected.append(total)
    assert len(tokenizer.encode(texts[0])) > 3 * 16  # several windows
    assert len(tokenizer.encode(texts[0])) % 16  # and a last, partial one
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), i)
                                    for i, text in enumerate(texts)])
    np.testing.assert_allclose(got, expected, atol=1e-4)

    context = tokenizer.encode(texts[0])
    continuation = tokenizer.encode(texts[0] + " cat")[len(context):]
    kept = context[-(16 + 1 - len(continuation)):]
    (logprob, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, (texts[0], " cat"), 0)])
    assert (logprob, greedy) == pytest.approx(tuple(score(config, params, [kept],
                                                          [continuation])[0]), abs=1e-5)


def test_generation_settings_as_lm_eval_reads_them():
    """lm-eval's normalisation: greedy when do_sample is false or unset without a positive
    temperature; the EOS token's text joins the stop strings."""
    settings = harness._generation_settings
    assert settings({"until": "\n", "do_sample": False, "temperature": 0.7}, 256, "</s>") == (
        ["\n", "</s>"], 256, {"temperature": 0.0})
    assert settings({"temperature": 0.5, "top_p": 0.9, "max_gen_toks": "9"}, 256, "</s>") == (
        ["</s>"], 9, {"temperature": 0.5, "top_p": 0.9})
    assert settings({"until": ["a", ""]}, 7, "</s>") == (["a", "</s>"], 7, {"temperature": 0.0})
    with pytest.raises(ValueError, match="sampling needs a positive temperature"):
        settings({"do_sample": True}, 256, "</s>")
    with pytest.raises(ValueError, match=r"generation kwargs \['num_beams'\] are not supported"):
        settings({"num_beams": 4}, 256, "</s>")


def test_generate_until_is_greedy_decoding_cut_at_a_stop_string(checkpoint, model,
                                                                  monkeypatch):
    """Two rows in a batch, each with a stop string early in its text: decoding stops after
    the chunk that completes them; a request with other settings runs in its own batch."""
    config, params, tokenizer = model
    lm = LlamaJaxLM(checkpoint=str(checkpoint), batch_size=2)
    contexts = ["The cat", "A dog is", "Numbers: 12"]
    prompts = [tokenizer.encode(c) for c in contexts]

    def greedy_text(prompt, n):  # the new tokens decoded alone, as lm-eval's hf model does
        return tokenizer.decode(generate(config, params, [prompt], n)[0])

    def early_stop(text):  # printable: an untrained model emits many invalid bytes (U+FFFD)
        return next(text[i:i + 2] for i in range(3, len(text)) if text[i:i + 2].isprintable()
                    and text[i:i + 2].isascii())

    texts = [greedy_text(p, 40) for p in prompts[:2]]
    stops = [early_stop(text) for text in texts]
    gen_kwargs = {"until": stops, "max_gen_toks": 40, "do_sample": False}
    requests = [Instance("generate_until", {}, (c, gen_kwargs), i)
                for i, c in enumerate(contexts[:2])]
    requests.append(Instance("generate_until", {}, (contexts[2], {"until": "\n\n",
                                                                   "max_gen_toks": 5}), 2))
    yields = []  # per batch: the chunks of tokens it took from the decoder
    copies = []  # whether the unrolled decoder's copy of the weights was held, per chunk

    def counted_stream(*args, **kwargs):
        yields.append(0)
        for chunk in decoder_stream(*args, **kwargs):
            yields[-1] += 1
            copies.append(decoder._cached_copy(lm.params) is not None)
            yield chunk

    decoder_stream = harness.stream
    monkeypatch.setattr(harness, "stream", counted_stream)
    got = lm.generate_until(requests)
    # The copy lives while generating (on CPU "auto" decodes unrolled), not for scoring after.
    assert all(copies) and decoder._cached_copy(lm.params) is None
    pattern = "|".join(map(re.escape, stops))
    assert got == [re.split(pattern, texts[0])[0], re.split(pattern, texts[1])[0],
                   greedy_text(prompts[2], 5)]
    assert len(got[0]) < len(texts[0]) and len(got[1]) < len(texts[1])
    assert yields[0] < 1 + 3  # the first token, then 39 in chunks of STOP_CHECK_STEPS = 16
    assert yields[1] == 2


def test_the_command_line_reports_the_same_accuracy(checkpoint, task_dir, evaluation,
                                                    tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "llama_jax.eval.harness", "--model", "llama_jax",
         "--model_args", f"checkpoint={checkpoint},batch_size=4", "--tasks", TASK,
         "--include_path", str(task_dir), "--output_path", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    assert results["results"][TASK]["acc,none"] == evaluation["results"][TASK]["acc,none"]
    assert TASK in run.stdout  # the results table
