"""The chat fine-tuning recipe's data (research/module_chats.py): reStructuredText reduced to
the text a reader sees, one conversation per module page answered by its first prose
paragraph, and a split decided by the module's name."""

import json

from llama_jax.research import module_chats

PAGE = """:mod:`{name}` --- Something
===========================

.. module:: {name}
   :synopsis: Does things.

**Source code:** :source:`Lib/{name}.py`

--------------

{first}

Second paragraph that is long enough to count as prose for the demo task's paragraph
finder, with more than twenty words in it, surely by now.
"""


def test_markup_is_reduced_to_its_text():
    text = ("The :mod:`json` module (see :rfc:`7159` and :pep:`8`) uses "
            ":func:`~os.path.join`, ``dumps()``, **bold** and *emphasis*, with a "
            "`link <https://json.org>`_ and a footnote [#note]_.")
    assert module_chats.plain(text) == (
        "The json module (see RFC 7159 and PEP 8) uses os.path.join, dumps(), bold and "
        "emphasis, with a link and a footnote.")


def write_corpus(root, pages):
    (root / "library").mkdir(parents=True)
    for file, name, first in pages:
        (root / "library" / file).write_text(PAGE.format(name=name, first=first))


def test_each_module_page_is_a_conversation_answered_by_its_first_prose_paragraph(tmp_path):
    prose = ("The spam module provides eggs for breakfast. It is used with ham, in many "
             "recipes, and is documented here at some length so that the paragraph finder "
             "keeps it. A third sentence is cut.")
    write_corpus(tmp_path, [
        ("spam.rst.txt", "spam", prose),
        ("eggs.rst.txt", "eggs", "* a list item that is long enough to be kept as a paragraph "
                                 "by the finder if lists were prose, which they are not here"),
    ])
    (tmp_path / "library" / "intro.rst.txt").write_text("No module directive here.\n")
    records = module_chats.module_conversations(tmp_path)
    by_id = {r["id"]: r for r in records}
    assert by_id["spam"]["messages"][1]["content"] == (
        "The spam module provides eggs for breakfast. It is used with ham, in many recipes, "
        "and is documented here at some length so that the paragraph finder keeps it.")
    assert "spam" in by_id["spam"]["messages"][0]["content"]
    # eggs' first paragraph is a list item: its answer is the next prose paragraph
    assert by_id["eggs"]["messages"][1]["content"].startswith("Second paragraph")
    assert set(by_id) == {"spam", "eggs"}


def test_a_modules_split_follows_its_name_not_its_file(tmp_path):
    pages = [(f"m{i}.rst.txt", f"mod{i}", f"Module {i} does a thing that takes twenty or more "
              "words to describe in this sentence, which keeps going and going on.")
             for i in range(30)]
    write_corpus(tmp_path / "a", pages)
    write_corpus(tmp_path / "b", [(f"renamed{i}.rst.txt", name, first)
                                  for i, (_, name, first) in enumerate(reversed(pages))])
    splits = []
    for corpus in ("a", "b"):
        counts = module_chats.build(tmp_path / corpus, tmp_path / corpus / "out")
        assert counts["train"] + counts["val"] == 30 and counts["val"] >= 1
        splits.append({json.loads(line)["id"] for line in
                       (tmp_path / corpus / "out" / "val.jsonl").read_text().splitlines()})
    assert splits[0] == splits[1]
