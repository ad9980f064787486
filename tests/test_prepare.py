"""`python -m llama_jax.data.prepare`: prepared token shards equal the raw corpus reader's
tokens, the same bytes for any number of workers and hosts, resumed where a killed prepare
stopped, and bad input named by file and line or skipped and counted."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from llama_jax.config import DataConfig
from llama_jax.data import corpus as corpora, documents, prepare as prep
from llama_jax.errors import DataError

VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer(corpus_dir, tmp_path_factory):
    corpus = corpora.find_corpus(str(corpus_dir), 0.1)
    tok = corpora.prepare_tokenizer(DataConfig(corpus=str(corpus_dir)), corpus, VOCAB,
                                    tmp_path_factory.mktemp("tok"), log=lambda _: None)
    return tok


@pytest.fixture(autouse=True)
def small_units(monkeypatch):
    monkeypatch.setattr(documents, "UNIT_BYTES", 100_000)  # several units from the test corpus


def run(inputs, tokenizer, out, **kw):
    return prep.prepare([str(i) for i in inputs], tokenizer.path, out, log=lambda _: None,
                        progress=False, **{"val_fraction": 0.1, **kw})


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def split_tokens(out: Path, split: str) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([np.fromfile(out / "shards" / f"{s['unit']:05d}.{split}.bin",
                                       meta["dtype"]) for s in meta["shards"]])


def test_prepared_tokens_are_the_documents_for_any_workers_and_hosts(corpus_dir, tokenizer,
                                                                       tmp_path):
    one = tmp_path / "one"
    meta = run([corpus_dir], tokenizer, one)
    assert len(meta["shards"]) >= 4
    corpus = corpora.find_corpus(str(corpus_dir), 0.1)
    for split in ("train", "val"):  # the raw reader's split and order
        expected = np.concatenate([tokenizer.encode(corpora.read_document(p), bos=True,
                                                    eos=True) for p in getattr(corpus, split)])
        np.testing.assert_array_equal(split_tokens(one, split), expected)
    offsets = np.fromfile(one / "shards" / "00000.train.idx", np.uint64)
    tokens = np.fromfile(one / "shards" / "00000.train.bin", meta["dtype"])
    assert offsets[-1] == tokens.size and (tokens[offsets[:-1].astype(int)] ==
                                           tokenizer.bos_id).all()
    two = tmp_path / "two"
    run([corpus_dir], tokenizer, two, workers=2)
    hosts = tmp_path / "hosts"
    assert run([corpus_dir], tokenizer, hosts, shard=(1, 2)) is None  # host 0 not done yet
    run([corpus_dir], tokenizer, hosts, shard=(0, 2))
    assert tree(one) == tree(two) == tree(hosts)


def test_a_killed_prepare_redoes_only_what_it_left_unfinished(corpus_dir, tokenizer, tmp_path):
    out = tmp_path / "out"
    run([corpus_dir], tokenizer, out)
    whole = tree(out)
    shard = out / "shards" / "00001.train.bin"
    shard.write_bytes(shard.read_bytes()[:-10])  # cut short
    (out / "ledger" / "00002.json").unlink()  # never finished
    (out / "meta.json").unlink()
    before = (out / "shards" / "00003.train.bin").stat().st_mtime_ns
    run([corpus_dir], tokenizer, out)
    assert tree(out) == whole
    assert (out / "shards" / "00003.train.bin").stat().st_mtime_ns == before  # not redone
    with pytest.raises(DataError, match="prepared from other inputs"):
        run([corpus_dir / "sub"], tokenizer, out)


def write_jsonl(path: Path, lines: list[str]) -> None:
    data = ("\n".join(lines) + "\n").encode()
    if path.suffix == ".gz":
        data = gzip.compress(data)
    elif path.suffix == ".zst":
        data = pytest.importorskip("zstandard").ZstdCompressor().compress(data)
    path.write_bytes(data)


def test_jsonl_documents_and_bad_lines(tokenizer, tmp_path):
    docs = ["def f(x):\n    return x + 1\n", "The json module", "", "import os\nos.sep",
            "print('zstd')"]
    src = tmp_path / "src"
    src.mkdir()
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(docs)]
    write_jsonl(src / "a.jsonl.gz", lines[:2])
    write_jsonl(src / "b.jsonl", lines[2:4] + ['{"text": 3}', "{not json"])
    write_jsonl(src / "c.jsonl.zst", lines[4:])
    with pytest.raises(DataError, match=r"b\.jsonl: line 3: no string under 'text'"):
        run([src], tokenizer, tmp_path / "strict")
    meta = run([src], tokenizer, tmp_path / "lenient", skip_bad=True)
    assert (meta["empty_documents"], meta["skipped_no_text"], meta["skipped_not_json"]) == \
        (1, 1, 1)
    assert meta["train"]["documents"] + meta["val"]["documents"] == 4
    got = sorted(np.concatenate([split_tokens(tmp_path / "lenient", s)
                                 for s in ("train", "val")]).tolist())
    want = sorted(t for d in docs if d for t in tokenizer.encode(d, bos=True, eos=True))
    assert got == want


def split_documents(out: Path, split: str) -> list[tuple[int, ...]]:
    """The documents of a prepared split, each as its tokens, sorted."""
    meta = json.loads((out / "meta.json").read_text())
    documents_ = []
    for shard in meta["shards"]:
        stem = out / "shards" / f"{shard['unit']:05d}.{split}"
        tokens = np.fromfile(f"{stem}.bin", meta["dtype"])
        offsets = np.fromfile(f"{stem}.idx", np.uint64).astype(int)
        documents_ += [tuple(tokens[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]
    return sorted(documents_)


def test_a_record_splits_by_its_id_or_text_wherever_it_is_stored(tokenizer, tmp_path):
    """The same 40 records prepared from one JSONL file, from a renamed and compressed copy,
    and re-cut into two files in another order: the same documents in validation each time
    (keyed by file name and line, the copies put 1-4 of them there, different ones). A record
    with an `id` keeps its split when its text changes."""
    texts = [f"record {i}: " + "def f(x): return x * %d\n" % i for i in range(40)]
    with_ids = [json.dumps({"text": t, "id": f"doc-{i}"}) for i, t in enumerate(texts)]
    plain = [json.dumps({"text": t}) for t in texts]
    splits = []
    for lines in (with_ids, plain):
        layouts = {"one": {"all.jsonl": lines},
                   "renamed": {"renamed.jsonl.gz": lines},
                   "recut": {"x.jsonl": lines[25:][::-1], "y.jsonl.gz": lines[:25]}}
        for layout, files in layouts.items():
            src = tmp_path / f"{len(splits)}-{layout}"
            src.mkdir()
            for file, part in files.items():
                write_jsonl(src / file, part)
            out = tmp_path / f"{len(splits)}-{layout}-out"
            run([src], tokenizer, out, val_fraction=0.2)
            splits.append(split_documents(out, "val"))
        assert splits[-1] == splits[-2] == splits[-3] and 0 < len(splits[-1]) < 40
    edited = [json.dumps({"text": t.upper(), "id": f"doc-{i}"}) for i, t in enumerate(texts)]
    (tmp_path / "edited").mkdir()
    write_jsonl(tmp_path / "edited" / "e.jsonl", edited)
    run([tmp_path / "edited"], tokenizer, tmp_path / "edited-out", val_fraction=0.2)

    def indices(documents_, texts_):
        by_tokens = {tuple(tokenizer.encode(t, bos=True, eos=True)): i
                     for i, t in enumerate(texts_)}
        return sorted(by_tokens[d] for d in documents_)

    edited_val = split_documents(tmp_path / "edited-out", "val")
    assert indices(edited_val, [t.upper() for t in texts]) == indices(splits[0], texts)


def test_non_utf8_text_is_named_by_file_and_line(tokenizer, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("fine text\n" * 3)
    (src / "bad.txt").write_bytes(b"line one\nline two \xff\xfe\n")
    with pytest.raises(DataError, match=r"bad\.txt: line 2: not UTF-8"):
        run([src], tokenizer, tmp_path / "out")
    meta = run([src], tokenizer, tmp_path / "skipped", skip_bad=True)
    assert meta["skipped_not_utf8"] == 1
    assert meta["train"]["documents"] + meta["val"]["documents"] == 1


def test_a_long_document_is_encoded_in_pieces_at_line_ends(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "PIECE_BYTES", 64)
    text = "".join(f"line {i} of a long document\n" for i in range(50))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "long.txt").write_text(text)
    (tmp_path / "src" / "other.txt").write_text("x = 1\n")
    pieces = list(documents.text_pieces(tmp_path / "src" / "long.txt", "long.txt"))
    assert len(pieces) > 10 and "".join(pieces) == text
    assert all(p.endswith("\n") for p in pieces)
    meta = run([tmp_path / "src"], tokenizer, tmp_path / "out", val_fraction=0.0)
    tokens = split_tokens(tmp_path / "out", "train").tolist()
    expected = [tokenizer.bos_id] + [t for p in pieces for t in tokenizer.encode(
        p, bos=False)] + tokenizer.encode("", bos=False, eos=True)
    assert tokens[:len(expected)] == expected and meta["train"]["documents"] == 2


def test_parquet_rows_are_documents(tokenizer, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = ["import sys\nprint(sys.argv)\n", None, "def g():\n    pass\n", ""]
    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"content": texts, "id": [1, 2, 3, 4]}),
                   tmp_path / "src" / "part-0.parquet", row_group_size=2)
    with pytest.raises(DataError, match="no column 'text'.*content, id"):
        run([tmp_path / "src"], tokenizer, tmp_path / "wrong-key")
    with pytest.raises(DataError, match=r"part-0\.parquet: row 2: 'content' is not a string"):
        run([tmp_path / "src"], tokenizer, tmp_path / "strict", text_key="content")
    meta = run([tmp_path / "src"], tokenizer, tmp_path / "out", text_key="content",
               skip_bad=True, val_fraction=0.0)
    assert (meta["skipped_no_text"], meta["empty_documents"]) == (1, 1)
    expected = [t for text in texts if text for t in tokenizer.encode(text, bos=True, eos=True)]
    assert split_tokens(tmp_path / "out", "train").tolist() == expected


def test_files_of_different_inputs_never_share_a_name(tokenizer, tmp_path):
    """Two inputs holding the same relative names (each a part-0.jsonl) are both prepared:
    with several inputs, names are relative to the directory the inputs share."""
    for source, text in (("web", "from the web"), ("books", "from a book")):
        (tmp_path / source).mkdir()
        write_jsonl(tmp_path / source / "part-0.jsonl", [json.dumps({"text": text})] * 3)
    meta = run([tmp_path / "web", tmp_path / "books"], tokenizer, tmp_path / "out")
    assert meta["files"] == 2
    assert meta["train"]["documents"] + meta["val"]["documents"] == 6
    names = [f["name"] for u in json.loads((tmp_path / "out" / "plan.json").read_text())["units"]
             for f in u["files"]]
    assert names == ["books/part-0.jsonl", "web/part-0.jsonl"]
