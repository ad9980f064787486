"""The data pipeline: corpus split, tokenizer training, token cache, packing, iterator state."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.data import batches, corpus as corpora
from llama_jax.errors import DataError
from llama_jax.config import DataConfig, ModelConfig
from llama_jax.model.transformer import forward
from llama_jax.model.params import init_params

VOCAB = 512


@pytest.fixture(scope="module")
def prepared(corpus_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    corpus = corpora.find_corpus(str(corpus_dir), 0.1)
    tokenizer = corpora.prepare_tokenizer(DataConfig(corpus=str(corpus_dir)), corpus, VOCAB,
                                       workdir, log=lambda _: None)
    return corpus, tokenizer, corpora.corpus_tokens(str(corpus_dir), 0.1, tokenizer,
                                                    log=lambda _: None)


def test_split_holds_out_whole_documents_stably(corpus_dir, tmp_path):
    corpus = corpora.find_corpus(str(corpus_dir), 0.1)
    files = {p for p in corpus_dir.rglob("*") if p.is_file() and p.name != ".hidden.txt"}
    assert set(corpus.train) | set(corpus.val) == files
    assert not set(corpus.train) & set(corpus.val)
    assert 1 <= len(corpus.val) < len(files) // 4
    moved = shutil.copytree(corpus_dir, tmp_path / "elsewhere")  # the split is by relative name
    again = corpora.find_corpus(str(moved), 0.1)
    assert [p.relative_to(moved) for p in again.val] == [p.relative_to(corpus_dir)
                                                          for p in corpus.val]
    by_glob = corpora.find_corpus(str(corpus_dir / "**" / "*.txt"), 0.1)
    assert set(by_glob.train) | set(by_glob.val) == files


def test_bad_corpora_are_named(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="missing': no such directory$"):
        corpora.find_corpus(str(tmp_path / "missing"), 0.1)
    monkeypatch.setattr(corpora, "DEFAULT_CORPUS", str(tmp_path / "no-docs"))  # as on a fresh host
    with pytest.raises(DataError, match="apt-get install python3.11-doc"):
        corpora.find_corpus(str(tmp_path / "no-docs"), 0.1)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("only one document")
    with pytest.raises(DataError, match="found 1 file"):
        corpora.find_corpus(str(tmp_path / "one"), 0.1)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8 \x80")
    with pytest.raises(DataError, match="bad.txt: cannot read as UTF-8"):
        corpora.read_document(bad)


def test_trained_tokenizer_round_trips_text_verbatim(prepared):
    _, tokenizer, _ = prepared
    assert tokenizer.vocab_size == VOCAB and tokenizer.bos_id == 1 and tokenizer.eos_ids == (2,)
    text = "def f(x):\n    return {'naïve': x ** 2}  # 12345\n\n\ttabs   and  spaces — ok\n"
    ids = tokenizer.encode(text, bos=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # it learned merges, not just bytes


def test_a_raw_corpus_is_prepared_once_as_bos_doc_eos(prepared, monkeypatch):
    """The tokens are the documents' `BOS doc EOS` in the corpus's order (what the reader
    before prepared shards wrote), and a second run opens the prepared form again."""
    corpus, tokenizer, tokens = prepared
    for split in ("train", "val"):
        expected = np.concatenate([tokenizer.encode(corpora.read_document(p), bos=True,
                                                    eos=True) for p in getattr(corpus, split)])
        np.testing.assert_array_equal(np.asarray(getattr(tokens, split)), expected)
    assert tokens.train.dtype == np.uint16 and (tokens.dataset / "meta.json").is_file()
    monkeypatch.setattr(corpora, "prepare", lambda *a, **k: pytest.fail("prepared again"))
    again = corpora.corpus_tokens(str(corpus.root), 0.1, tokenizer, log=lambda _: None)
    assert again.dataset == tokens.dataset


def test_changing_a_document_prepares_afresh(prepared, tmp_path):
    corpus, tokenizer, tokens = prepared
    copy = shutil.copytree(corpus.root, tmp_path / "docs")  # names, sizes and times kept
    same = corpora.corpus_tokens(str(copy), 0.1, tokenizer, log=lambda _: None)
    assert same.dataset == tokens.dataset  # not the location
    changed = corpora.find_corpus(str(copy), 0.1)
    changed.train[0].write_text(changed.train[0].read_text() + "\nmore text\n")
    other = corpora.corpus_tokens(str(copy), 0.1, tokenizer, log=lambda _: None)
    assert other.dataset != tokens.dataset
    assert len(other.train) > len(tokens.train)


def test_a_prepared_corpus_is_read_with_its_own_tokenizer_only(prepared, tmp_path):
    corpus, tokenizer, tokens = prepared
    workdir = tmp_path / "run"
    data = DataConfig(corpus=str(tokens.dataset))
    kept = corpora.corpus_tokenizer(data, VOCAB, workdir, log=lambda _: None)
    assert (workdir / "tokenizer.model").read_bytes() == Path(tokenizer.path).read_bytes()
    opened = corpora.corpus_tokens(data.corpus, 0.1, kept, log=lambda _: None)
    np.testing.assert_array_equal(np.asarray(opened.val), np.asarray(tokens.val))
    (tmp_path / "other").mkdir()
    other = corpora.prepare_tokenizer(DataConfig(corpus=str(corpus.root)), corpus, VOCAB - 64,
                                      tmp_path / "other", log=lambda _: None)
    with pytest.raises(DataError, match="prepared with another tokenizer"):
        corpora.corpus_tokens(data.corpus, 0.1, other, log=lambda _: None)
    with pytest.raises(DataError, match="more than model.vocab_size=256"):
        corpora.corpus_tokenizer(data, 256, tmp_path / "small", log=lambda _: None)


def test_features_match_a_reference_loop():
    rng = np.random.default_rng(0)
    bos = 1
    window = rng.integers(3, 100, (4, 41))
    window[rng.random(window.shape) < 0.1] = bos
    window[2, 0] = bos
    f = batches.features(jnp.asarray(window, jnp.int32), bos)
    for b in range(4):
        segment, position = 0, 0
        for t in range(40):
            if window[b, t] == bos:
                segment, position = segment + 1, 0
            assert f.segment_ids_BT[b, t] == segment and f.positions_BT[b, t] == position
            assert f.weights_BT[b, t] == (window[b, t + 1] != bos)
            position += 1
    np.testing.assert_array_equal(f.targets_BT, window[:, 1:])


def test_packed_documents_compute_what_they_compute_alone():
    config = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         multiple_of=16, max_seq_len=64)
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(1)
    doc_a, doc_b = rng.integers(3, 64, 9), rng.integers(3, 64, 13)
    tail = rng.integers(3, 64, 5)  # the end of a document from the previous window
    window = np.concatenate([tail, [1], doc_a, [2], [1], doc_b, [2]])[None]
    f = batches.features(jnp.asarray(window, jnp.int32), bos_id=1)
    packed = forward(config, params, f.inputs_BT, positions_BT=f.positions_BT,
                     segment_ids_BT=f.segment_ids_BT)[0]
    alone_b = forward(config, params, jnp.asarray([[1, *doc_b, 2]]))[0]
    start_b = len(tail) + 1 + len(doc_a) + 1  # doc_b's BOS; the window's last EOS is a target
    np.testing.assert_allclose(packed[start_b:], alone_b[:len(doc_b) + 1], rtol=1e-5, atol=1e-5)
    alone_tail = forward(config, params, jnp.asarray([tail]))[0]
    np.testing.assert_allclose(packed[:len(tail)], alone_tail, rtol=1e-5, atol=1e-5)


def test_iterator_is_deterministic_and_resumes_from_its_state():
    tokens = np.arange(1, 8 * 10 + 2, dtype=np.uint16)  # 10 windows of 8 (+1 shared token)
    first = batches.train_batches(tokens, 8, 2, seed=3)
    head = [next(first) for _ in range(4)]
    state = first.get_state()
    rest = [next(first) for _ in range(9)]  # runs into the second and third epoch
    resumed = batches.train_batches(tokens, 8, 2, seed=3)
    resumed.set_state(state)
    for a, b in zip(rest, (next(resumed) for _ in range(9))):
        np.testing.assert_array_equal(a, b)
    again = batches.train_batches(tokens, 8, 2, seed=3)
    np.testing.assert_array_equal(next(again), head[0])
    epoch1 = np.concatenate(head + rest[:1])[:, 0]  # window starts, 5 batches = one epoch
    epoch2 = np.concatenate(rest[1:6])[:, 0]
    assert sorted(epoch1) == sorted(epoch2) == list(range(1, 81, 8))
    assert list(epoch1) != list(epoch2)  # reshuffled each epoch
    other_seed = batches.train_batches(tokens, 8, 2, seed=4)
    assert not all(np.array_equal(next(other_seed), h) for h in head)


def test_unigram_entropy_ignores_bos():
    tokens = np.array([1, 5, 5, 7, 2, 1, 5, 7, 7, 2], np.uint16)  # 1 = BOS
    p = np.array([3, 3, 2]) / 8  # tokens 5, 7, 2
    assert corpora.unigram_entropy(tokens, bos_id=1) == pytest.approx(-(p * np.log(p)).sum())


def test_batches_of_one_row_are_the_same_windows_in_the_same_order():
    """Long-context runs train on one sequence per step (configs/demo-long.yaml)."""
    tokens = np.arange(1, 8 * 10 + 2, dtype=np.uint16)
    pairs = batches.train_batches(tokens, 8, 2, seed=3)
    singles = batches.train_batches(tokens, 8, 1, seed=3)
    for _ in range(7):  # into the second epoch
        np.testing.assert_array_equal(next(pairs), np.concatenate([next(singles),
                                                                   next(singles)]))


def test_a_mixture_draws_each_source_by_weight_for_any_process_count():
    """Three sources of distinct tokens: over 10k sequences each source's share is its weight
    (to 1%), each process reads its rows of the same global batches, and a restored iterator
    continues the sequence."""
    rng = np.random.default_rng(0)
    sources = [(rng.integers(100 * i, 100 * i + 100, n).astype(np.uint16), w)
               for i, (n, w) in enumerate([(20_000, 6.0), (3_000, 3.0), (50_000, 1.0)])]
    seq, batch = 16, 40
    whole = batches.mixed_batches(sources, seq, batch, seed=3)
    rows = np.concatenate([next(whole) for _ in range(250)])  # 10,000 sequences
    shares = np.bincount(rows[:, 0] // 100, minlength=3) / len(rows)
    np.testing.assert_allclose(shares, [0.6, 0.3, 0.1], atol=0.01)
    assert all(len(set(r // 100)) == 1 for r in rows)  # a window comes from one source
    first = batches.mixed_batches(sources, seq, batch, seed=3)
    halves = [batches.mixed_batches(sources, seq, batch, seed=3, process_index=p,
                                    process_count=2) for p in range(2)]
    for _ in range(3):
        parts = [next(h) for h in halves]
        merged = np.empty_like(np.concatenate(parts))
        merged[0::2], merged[1::2] = parts
        np.testing.assert_array_equal(merged, next(first))
    restored = batches.mixed_batches(sources, seq, batch, seed=3)
    restored.set_state(halves[0].get_state())
    np.testing.assert_array_equal(next(restored), next(first))
    other_seed = batches.mixed_batches(sources, seq, batch, seed=4)
    assert not np.array_equal(next(other_seed), rows[:batch])
