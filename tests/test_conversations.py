"""Chat data for supervised fine-tuning (data/conversations.py): the assistant's tokens found
in a rendered conversation (against the conversation rendered by hand, and by a template's
`{% generation %}` marks), bad lines named, long conversations refused or cut, and packed rows
that compute, conversation by conversation, what each computes alone."""

import dataclasses
import functools
import io

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.data.chat_template import ChatTemplate
from llama_jax.data.chat_rows import pack
from llama_jax.data.conversations import encode, read_conversations
from llama_jax.errors import DataError
from llama_jax.model.transformer import forward

from checkpoints import TEXT
from chats import chats, write
from models import TINY, random_params

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + "
          "'<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The same format, its assistant turns marked for training
CHATML_MARKED = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}"
                 "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>\n' }}"
                 "{% endgeneration %}{% else %}{{ m.content + '<|im_end|>\n' }}{% endif %}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "The cat sat?"},
            {"role": "assistant", "content": "On the mat."},
            {"role": "user", "content": "And the dog?"},
            {"role": "assistant", "content": "A good friend."}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_writer=model,
                                   vocab_size=300, model_type="bpe", byte_fallback=True,
                                   control_symbols=["<|im_start|>", "<|im_end|>"],
                                   minloglevel=2)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return llama_jax.load_tokenizer(path)


def by_hand(tokenizer) -> tuple[list[int], list[bool]]:
    """MESSAGES in ChatML written out, each piece with whether the assistant's turn is it: its
    content and end of turn, not its header."""
    start, end = (tokenizer.special_tokens[t] for t in ("<|im_start|>", "<|im_end|>"))
    ids, mine = [], []
    for piece, assistant in [
            ([start], False), ("system\nBe brief.", False), ([end], False), ("\n", False),
            ([start], False), ("user\nThe cat sat?", False), ([end], False), ("\n", False),
            ([start], False), ("assistant\n", False), ("On the mat.", True), ([end], True),
            ("\n", True),
            ([start], False), ("user\nAnd the dog?", False), ([end], False), ("\n", False),
            ([start], False), ("assistant\n", False), ("A good friend.", True), ([end], True),
            ("\n", True)]:
        piece_ids = piece if isinstance(piece, list) else tokenizer.encode(piece, bos=False)
        ids += piece_ids
        mine += [assistant] * len(piece_ids)
    return ids, mine


@pytest.mark.parametrize("text", [CHATML, CHATML_MARKED], ids=["turn spans", "generation marks"])
def test_the_assistants_tokens_are_its_turns_content_and_end(tokenizer, text):
    """The pieces the template's text is cut into are encoded on their own, at control tokens
    as written by hand: the same ids, and the same marks, whichever way the spans are found."""
    conversation = encode(ChatTemplate("t", text), tokenizer, MESSAGES)
    ids, mine = by_hand(tokenizer)
    assert conversation.tokens.tolist() == ids
    assert conversation.assistant.tolist() == mine


@pytest.mark.parametrize("record, message", [
    ('{"messages": ', r"chats\.jsonl:2: not a JSON object"),
    ({"text": "hi"}, r"chats\.jsonl:2: no \"messages\" list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r":2: messages\[0\]: unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "x"}]}, r":2: no assistant turn"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
     r":2: messages\[0\]: content must be a string"),
])
def test_bad_lines_are_named(tokenizer, tmp_path, record, message):
    good = {"messages": MESSAGES}
    path = write(tmp_path / "chats.jsonl", [good, record])
    with pytest.raises(DataError, match=message):
        read_conversations(path, ChatTemplate("t", CHATML), tokenizer, 256, truncate=False)


def test_a_template_whose_turns_are_not_a_prefix_is_refused(tokenizer, tmp_path):
    """A template that renders the last turn apart (here: only the last user turn gets a
    marker) has no trustworthy spans."""
    odd = ("{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m.role }}: "
           "{{ m.content }}\n{% endfor %}")
    path = write(tmp_path / "chats.jsonl", [{"messages": MESSAGES}])
    with pytest.raises(DataError, match=r"chats\.jsonl:1: t: the chat template does not "
                                        r"render the conversation up to its assistant turn 2"):
        read_conversations(path, ChatTemplate("t", odd), tokenizer, 256, truncate=False)


def test_a_long_conversation_is_refused_or_cut(tokenizer, tmp_path):
    path = write(tmp_path / "chats.jsonl", [{"messages": MESSAGES}])
    n = len(encode(ChatTemplate("t", CHATML), tokenizer, MESSAGES).tokens)
    with pytest.raises(DataError, match=rf":1: {n} tokens, more than train.seq_len \+ 1 = 21"):
        read_conversations(path, ChatTemplate("t", CHATML), tokenizer, 20, truncate=False)
    (whole,) = read_conversations(path, ChatTemplate("t", CHATML), tokenizer, 20,
                                  truncate=True)
    assert len(whole.tokens) == n > 21
    row = pack([whole], 20, packing=True, pad_id=0)  # cut to the row: 20 inputs, 21 tokens
    np.testing.assert_array_equal(row["inputs_BT"][0], whole.tokens[:20])
    np.testing.assert_array_equal(row["targets_BT"][0], whole.tokens[1:21])
    np.testing.assert_array_equal(row["weights_BT"][0], whole.assistant[1:21])


def test_packed_rows_compute_what_each_conversation_computes_alone(tokenizer):
    """Three conversations of different lengths packed into rows of 128: each conversation's
    targets, weights and the model's logits at its positions are those of the conversation
    alone (segment ids keep attention within it, positions restart); unpacked, one per row.
    Weights are 1 exactly where the target is the assistant's."""
    template = ChatTemplate("t", CHATML)
    conversations = [encode(template, tokenizer, MESSAGES[:k]) for k in (3, 3, 5)]
    rng = np.random.default_rng(0)
    for c in conversations:  # random ids (the tiny model's vocabulary), same marks
        c.tokens[:] = rng.integers(3, 300, len(c.tokens))
    T = 128
    packed = pack(conversations, T, packing=True, pad_id=0)
    single = pack(conversations, T, packing=False, pad_id=0)
    assert len(single["inputs_BT"]) == 3 and len(packed["inputs_BT"]) < 3
    config = TINY
    params = random_params({"m": config})["m"]

    def logits(rows):
        return np.asarray(forward(config, params, jnp.asarray(rows["inputs_BT"]),
                                  positions_BT=jnp.asarray(rows["positions_BT"]),
                                  segment_ids_BT=jnp.asarray(rows["segment_ids_BT"])))

    packed_logits, single_logits = logits(packed), logits(single)
    row, at, segment = 0, 0, 1
    for i, c in enumerate(conversations):
        n = len(c.tokens) - 1
        if at + n > T:
            row, at, segment = row + 1, 0, 1
        span = slice(at, at + n)
        np.testing.assert_array_equal(packed["targets_BT"][row, span], c.tokens[1:])
        np.testing.assert_array_equal(packed["weights_BT"][row, span], c.assistant[1:])
        np.testing.assert_array_equal(packed["segment_ids_BT"][row, span], segment)
        np.testing.assert_allclose(packed_logits[row, span], single_logits[i, :n],
                                   rtol=2e-5, atol=2e-5)
        at, segment = at + n, segment + 1
    assert packed["weights_BT"][packed["segment_ids_BT"] == 0].sum() == 0


def test_the_chat_loss_counts_the_assistants_targets_only(tokenizer):
    """`lm_sums` on packed chat rows against a float64 reference from the model's logits:
    the cross-entropy summed over the targets that are the assistant's, and their count."""
    from llama_jax.training.step import lm_sums

    template = ChatTemplate("t", CHATML)
    conversations = [encode(template, tokenizer, MESSAGES[:k]) for k in (3, 5)]
    rows = pack(conversations, 160, packing=True, pad_id=0)
    config = TINY
    params = random_params({"m": config})["m"]
    _, (sums, _) = lm_sums(config, params, {k: jnp.asarray(v) for k, v in rows.items()},
                           z_loss=0.0)
    logits = np.asarray(forward(config, params, jnp.asarray(rows["inputs_BT"]),
                                positions_BT=jnp.asarray(rows["positions_BT"]),
                                segment_ids_BT=jnp.asarray(rows["segment_ids_BT"])), np.float64)
    log_p = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
                            ) - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(log_p, rows["targets_BT"][..., None], -1)[..., 0]
    scored = rows["weights_BT"] > 0
    assert scored.sum() == sum(c.assistant[1:].sum() for c in conversations) > 0
    assert float(sums["count"]) == scored.sum()
    np.testing.assert_allclose(float(sums["loss_sum"]), nll[scored].sum(), rtol=1e-5)


@pytest.mark.parametrize("loss_chunk", [None, 48])
def test_the_scored_only_head_gives_the_dense_losses_and_gradients(tokenizer, loss_chunk):
    """A chat run's LM head over the scored positions alone (pieces no row scores in are
    skipped): the dense head's sums and gradients (z-loss included), with and without
    `loss_chunk`'s rematerialised pieces; rows of 192 positions whose scored ones fit in fewer
    pieces than the row has, so some are skipped."""
    from llama_jax.training import cross_entropy
    from llama_jax.training.step import lm_sums

    template = ChatTemplate("t", CHATML)
    conversations = [encode(template, tokenizer, MESSAGES[:k]) for k in (3, 5, 3)]
    rng = np.random.default_rng(1)
    for c in conversations:
        c.tokens[:] = rng.integers(3, 300, len(c.tokens))
    rows = {k: jnp.asarray(v) for k, v in pack(conversations, 192, False, 0).items()}
    piece = loss_chunk or cross_entropy.SCORED_PIECE
    assert int(jnp.max(jnp.sum(rows["weights_BT"] > 0, 1))) <= 192 - piece  # one skipped
    config = dataclasses.replace(TINY, loss_chunk=loss_chunk)
    params = random_params({"m": config})["m"]

    def sums(params, scored_only):
        total, (parts, _) = lm_sums(config, params, rows, z_loss=1e-3, scored_only=scored_only)
        return total, parts

    (dense, dense_parts), dense_grad = jax.value_and_grad(sums, has_aux=True)(params, False)
    (ours, parts), grad = jax.value_and_grad(sums, has_aux=True)(params, True)
    np.testing.assert_allclose(float(ours), float(dense), rtol=1e-6)
    assert float(parts["count"]) == float(dense_parts["count"])
    np.testing.assert_allclose(float(parts["loss_sum"]), float(dense_parts["loss_sum"]),
                               rtol=1e-6)
    chex.assert_trees_all_close(grad, dense_grad, rtol=2e-5, atol=1e-7)
    hlo = jax.jit(functools.partial(sums, scored_only=True)).lower(params).as_text()
    assert "stablehlo.case" in hlo or "conditional" in hlo


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A chat fine-tuning run of 30 steps from a tiny checkpoint without a chat template (its
    outcome holds the untrained model's validation metrics too, from before step 1)."""
    import yaml

    from checkpoints import tiny_checkpoint_with_tokenizer
    from llama_jax.training import finetune, trainer

    root = tmp_path_factory.mktemp("chat")
    pretrained = tiny_checkpoint_with_tokenizer(root / "lm")
    tree = {"init_from": str(pretrained),
            "task": {"kind": "chat", "train": chats(root / "train.jsonl", 96, 0),
                     "val": chats(root / "val.jsonl", 16, 1)},
            "train": {"seq_len": 128, "batch_size": 8, "steps": 30, "learning_rate": 3e-3,
                      "warmup_steps": 5, "log_every": 10, "eval_every": 30,
                      "checkpoint_every": 30}}
    (root / "chat.yaml").write_text(yaml.safe_dump(tree))
    run = finetune.load_run_config(root / "chat.yaml")
    logged = []
    outcome = trainer.train(run, root / "run", log=logged.append, progress=False)
    return run, root, outcome, logged


def test_a_chat_run_learns_its_conversations_and_keeps_its_format(chat_run):
    """`task: {kind: chat}` from a checkpoint without a chat template: the run learns the
    answers (validation loss on the assistant's tokens far below the untrained model's), and
    its workdir keeps the ChatML template it was trained in and the tokenizer, so a
    checkpoint of it chats in that format."""
    from llama_jax.data.chat_template import load_chat_template

    run, root, outcome, logged = chat_run
    assert run.model.head == "lm" and run.task.packing and not run.task.truncate
    assert any("task chat (ChatML" in line and "96 training conversations" in line
               for line in logged), logged
    untrained = outcome.val_metrics_before["val_loss"]
    assert outcome.val_loss < 0.6 * untrained, (outcome.val_loss, untrained)
    assert "<|im_start|>" in load_chat_template(root / "run").text
    assert (root / "run" / "tokenizer.model").is_file()


def test_a_chat_run_resumes_exactly(chat_run):
    """Stopped at step 15 and resumed: the same parameters as the run that went on."""
    import chex

    from llama_jax.training import trainer

    run, root, _, _ = chat_run
    first = trainer.train(run, root / "resumed", stop_at=15, log=lambda _: None,
                          progress=False)
    assert first.stopped_by == "stop_at"
    trainer.train(run, root / "resumed", log=lambda _: None, progress=False)
    chex.assert_trees_all_equal(llama_jax.load_checkpoint(root / "resumed")[1],
                                llama_jax.load_checkpoint(root / "run")[1])


def test_a_bad_chat_file_stops_the_run_before_anything_is_written(chat_run, tmp_path):
    from llama_jax.training import trainer

    run = chat_run[0]
    bad = write(tmp_path / "bad.jsonl", [{"messages": MESSAGES[:3]}, {"messages": [
        {"role": "user", "content": "x"}]}])
    run = dataclasses.replace(run, task=dataclasses.replace(run.task, train=bad))
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no assistant turn"):
        trainer.train(run, tmp_path / "run", log=lambda _: None, progress=False)
    assert not (tmp_path / "run").exists()  # no tokenizer, template or config.yaml


def prepare_chats(inputs, checkpoint, out, **kw):
    from llama_jax.data import prepare

    return prepare.prepare([str(i) for i in inputs], None, out, chat=checkpoint,
                           log=lambda _: None, progress=False, **kw)


def test_a_prepared_chat_dataset_gives_the_rows_of_its_jsonl(tokenizer, tmp_path):
    """`prepare --chat` over a JSONL file and a gzipped one: the same conversations, split the
    same way (by id) and in the same rows as the whole file read in memory; the same bytes for
    one worker or two."""
    import gzip

    from llama_jax.data import chat_rows, shards

    whole = chats(tmp_path / "whole.jsonl", 40, 3)
    lines = (tmp_path / "whole.jsonl").read_text().splitlines()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines[:25]) + "\n")
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt") as f:
        f.write("\n".join(lines[25:]) + "\n")
    checkpoint = tokenizer.path.parent  # a tokenizer and no chat template: ChatML
    metas = [prepare_chats([tmp_path / "in"], checkpoint, tmp_path / f"out{w}", workers=w,
                           val_fraction=0.25) for w in (1, 2)]
    assert metas[0] == metas[1] and metas[0]["kind"] == "chat"
    files = [{p.relative_to(tmp_path / f"out{w}"): p.read_bytes()
              for p in (tmp_path / f"out{w}").rglob("*") if p.is_file()} for w in (1, 2)]
    assert files[0] == files[1]
    template = conversations_template()
    read = functools.partial(chat_rows.chat_splits, val=None, val_fraction=0.25,
                             template=template, tokenizer=tokenizer, seq_len=64, truncate=True)
    prepared, in_memory = read(str(tmp_path / "out1")), read(whole)
    assert (metas[0]["train"]["documents"], metas[0]["val"]["documents"]) == (
        len(in_memory.train), len(in_memory.val)) and 0 < len(in_memory.val) < 40
    assert prepared.truncated(64) == in_memory.truncated(64) > 0  # some are cut to the row
    for name in ("train", "val"):
        rows = [chat_rows.Rows(getattr(s, name), 64, packing=True, pad_id=0)
                for s in (prepared, in_memory)]
        assert len(rows[0]) == len(rows[1]) > 0
        for r in range(len(rows[0])):
            for field in chat_rows.ROW_FIELDS:
                np.testing.assert_array_equal(rows[0][r][field], rows[1][r][field])
    assert isinstance(prepared.train.tokens, shards.ShardedTokens)  # memory-mapped, not read


def conversations_template():
    from llama_jax.data.conversations import chat_template_for

    return chat_template_for([])


def test_bad_chat_lines_are_named_or_skipped_and_counted(tokenizer, tmp_path):
    checkpoint = tokenizer.path.parent
    path = write(tmp_path / "chats.jsonl", [{"messages": MESSAGES}, {"messages": [
        {"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]},
        "{not json", {"messages": MESSAGES[:3]}])
    with pytest.raises(DataError, match=r"chats\.jsonl: line 2: messages\[1\]: unknown role "
                                        r"'robot'.*--skip-bad"):
        prepare_chats([path], checkpoint, tmp_path / "out")
    meta = prepare_chats([path], checkpoint, tmp_path / "skipped", skip_bad=True,
                         val_fraction=0.0)
    assert (meta["skipped_bad_chat"], meta["skipped_not_json"]) == (1, 1)
    assert meta["train"]["documents"] == 2
    text = write(tmp_path / "notes.txt", ["plain text"])
    with pytest.raises(DataError, match=r"notes\.txt: conversations are read from JSONL"):
        prepare_chats([text], checkpoint, tmp_path / "text")


def test_a_prepared_dataset_of_another_kind_tokenizer_or_template_is_refused(tokenizer,
                                                                             tmp_path):
    from llama_jax.data import chat_rows, corpus, prepare

    checkpoint = tokenizer.path.parent
    path = chats(tmp_path / "chats.jsonl", 8, 0)
    prepare_chats([path], checkpoint, tmp_path / "chat", val_fraction=0.3)
    read = functools.partial(chat_rows.chat_splits, str(tmp_path / "chat"), None, 0.1,
                             tokenizer=tokenizer, seq_len=64, truncate=True)
    read(template=conversations_template())
    with pytest.raises(DataError, match="prepared with another chat template than the run's"):
        read(template=ChatTemplate("t", CHATML_MARKED))
    with pytest.raises(DataError, match="a prepared set of conversations, not text corpus"):
        corpus.corpus_tokens(str(tmp_path / "chat"), 0.1, tokenizer)
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"{i}.txt").write_text(TEXT[i])
    prepare.prepare([str(tmp_path / "docs")], tokenizer.path, tmp_path / "text",
                    log=lambda _: None, progress=False)
    with pytest.raises(DataError, match="a prepared text corpus, not set of conversations"):
        chat_rows.chat_splits(str(tmp_path / "text"), None, 0.1, conversations_template(),
                              tokenizer, 64, True)
    with pytest.raises(DataError, match=r"conversation \d+ has \d+ tokens, more than "
                                        r"train.seq_len \+ 1 = 9"):
        read(template=conversations_template(), seq_len=8, truncate=False)


def test_a_chat_run_trains_the_same_from_a_prepared_dataset(chat_run, tmp_path):
    """The chat run's training file prepared (no validation held out: the run's task.val is
    its own file) trains to the same parameters, bitwise, as the file read whole."""
    import chex

    from llama_jax.training import trainer

    run = chat_run[0]
    prepare_chats([run.task.train], run.init_from, tmp_path / "prepared", val_fraction=0.0)
    from_file = dataclasses.replace(run, train=dataclasses.replace(run.train, eval_every=3))
    from_prepared = dataclasses.replace(from_file, task=dataclasses.replace(
        run.task, train=str(tmp_path / "prepared")))
    outcomes = [trainer.train(r, tmp_path / name, stop_at=3, log=lambda _: None,
                              progress=False)
                for name, r in (("file", from_file), ("prepared", from_prepared))]
    assert outcomes[0].val_loss == outcomes[1].val_loss
    chex.assert_trees_all_equal(llama_jax.load_checkpoint(tmp_path / "prepared")[1],
                                llama_jax.load_checkpoint(tmp_path / "file")[1])
