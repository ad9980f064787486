"""The lm-eval adapter against lm-eval's own transformers model (`hf`, HFLM) on the same tiny
checkpoint and local tasks of each output type: per-sample log-likelihoods within 1e-4
relative, the same is-greedy flags, the same generated strings and the same metrics.

Two checkpoints, as people evaluate them: LLaMA-2 style (a SentencePiece `tokenizer.model` and
a `tokenizer_config.json` naming LlamaTokenizer with a BOS, read through transformers by both),
and LLaMA-3 style (`tokenizer.json` for transformers; llama_jax reads the tiktoken file in
`original/`, as Meta ships it)."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf model needs it
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from lm_eval.tasks import TaskManager

import llama_jax.eval.harness  # noqa: F401  (registers "llama_jax")
from checkpoints import enlarge_weights
from llama_jax.data.tokenizer import (LLAMA3_NAMED_SPECIALS, LLAMA3_NUM_SPECIALS, LLAMA3_PATTERN,
                                      train_sentencepiece)

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASKS = {"llama_jax_tiny_mc": "tiny_mc", "llama_jax_tiny_rolling": "tiny_rolling",
         "llama_jax_tiny_gen": "tiny_gen"}
TEXT = ["The cat sat on the mat and looked at the dog.",
        "A dog is a good friend; a cat is a proud one.", "Numbers: 12 34 56 78 90.",
        "The cat and the dog are friends. Twelve plus one is thirteen.",
        "Cats and dogs sat on a mat next to the proud cat."] * 20
CONTEXT = 64  # max_position_embeddings: the rolling documents span several windows
LLAMA3_RANKS = 1000  # the first ranks of Meta's BPE file are a BPE of their own


def llama_model(path: Path, vocab_size: int, bos: int, eos: int, seed: int) -> None:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        bos_token_id=bos, eos_token_id=eos)).eval()
    enlarge_weights(model)
    model.save_pretrained(path)


def llama2_checkpoint(path: Path) -> dict:
    path.mkdir()
    (path / "tokenizer.model").write_bytes(train_sentencepiece(TEXT, 300))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False}))
    llama_model(path, 300, bos=1, eos=2, seed=0)
    return {}


def llama3_checkpoint(path: Path) -> dict:
    """Meta's first LLAMA3_RANKS BPE ranks and the 256 special tokens after them."""
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    llama_models = pytest.importorskip("llama_models")
    meta_file = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    (path / "original").mkdir(parents=True)
    ranks = meta_file.read_text().splitlines()[:LLAMA3_RANKS]
    (path / "original" / "tokenizer.model").write_text("\n".join(ranks) + "\n")
    specials = list(LLAMA3_NAMED_SPECIALS) + [
        f"<|reserved_special_token_{2 + i}|>"
        for i in range(LLAMA3_NUM_SPECIALS - len(LLAMA3_NAMED_SPECIALS))]
    bos, eos = LLAMA3_RANKS, LLAMA3_RANKS + 1
    backend = TikTokenConverter(vocab_file=str(path / "original" / "tokenizer.model"),
                                pattern=LLAMA3_PATTERN, extra_special_tokens=specials).converted()
    backend.post_processor = processors.Sequence([  # as Meta's tokenizer.json: BOS first
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>").save_pretrained(path)
    llama_model(path, LLAMA3_RANKS + LLAMA3_NUM_SPECIALS, bos=bos, eos=eos, seed=1)
    return {"tokenizer": str(path / "original")}


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory) -> TaskManager:
    """The tasks with absolute data paths and a datasets cache of their own."""
    root = tmp_path_factory.mktemp("tasks")
    for name in TASKS.values():
        task = yaml.safe_load((TASK_DIR / f"{name}.yaml").read_text())
        task["dataset_kwargs"] = {"data_files": {"test": str(TASK_DIR / f"{name}.jsonl")},
                                  "cache_dir": str(root / "datasets")}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return TaskManager(include_path=str(root), include_defaults=False)


def evaluate(model: str, model_args: str, task_manager: TaskManager) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                   task_manager=task_manager, log_samples=True,
                                   batch_size=4)


@pytest.fixture(scope="module", params=["llama2", "llama3"])
def both(request, tmp_path_factory, task_manager):
    """(lm-eval's hf model's evaluation, llama_jax's) of one checkpoint."""
    path = tmp_path_factory.mktemp(request.param) / "model"
    ours = {"llama2": llama2_checkpoint, "llama3": llama3_checkpoint}[request.param](path)
    hf = evaluate("hf", f"pretrained={path},dtype=float32,device=cpu", task_manager)
    args = ",".join(f"{k}={v}" for k, v in {"checkpoint": path, **ours}.items())
    return hf, evaluate("llama_jax", args, task_manager)


def per_sample(evaluation: dict, task: str) -> list:
    """Each document's raw responses, by document id."""
    samples = sorted(evaluation["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(samples)))
    return [s["resps"] for s in samples]


def test_multiple_choice_loglikelihoods_and_greedy_flags(both):
    hf, ours = (per_sample(e, "llama_jax_tiny_mc") for e in both)
    hf_logprobs = [[r[0][0] for r in doc] for doc in hf]
    our_logprobs = [[r[0][0] for r in doc] for doc in ours]
    for hf_doc, our_doc in zip(hf_logprobs, our_logprobs, strict=True):
        np.testing.assert_allclose(our_doc, hf_doc, rtol=1e-4)
    assert [[r[0][1] for r in doc] for doc in ours] == [[r[0][1] for r in doc] for doc in hf]
    assert both[1]["results"]["llama_jax_tiny_mc"]["acc,none"] == pytest.approx(
        both[0]["results"]["llama_jax_tiny_mc"]["acc,none"])


def test_rolling_loglikelihoods_and_perplexities(both):
    hf, ours = (per_sample(e, "llama_jax_tiny_rolling") for e in both)
    np.testing.assert_allclose([doc[0][0] for doc in ours], [doc[0][0] for doc in hf],
                               rtol=1e-4)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert both[1]["results"]["llama_jax_tiny_rolling"][metric] == pytest.approx(
            both[0]["results"]["llama_jax_tiny_rolling"][metric], rel=1e-4)


def test_generated_strings(both):
    hf, ours = (per_sample(e, "llama_jax_tiny_gen") for e in both)
    assert ours == hf
    assert all(doc[0][0] for doc in hf)  # non-empty texts: the comparison has content
    assert both[1]["results"]["llama_jax_tiny_gen"]["exact_match,none"] == (
        both[0]["results"]["llama_jax_tiny_gen"]["exact_match,none"])
