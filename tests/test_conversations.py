"""Chat data for supervised fine-tuning (data/conversations.py): the assistant's tokens found
in a rendered conversation (against the conversation rendered by hand, and by a template's
`{% generation %}` marks), bad lines named, long conversations refused or cut, and packed rows
that compute, conversation by conversation, what each computes alone."""

import dataclasses
import io

import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.data.chat_template import ChatTemplate
from llama_jax.data.conversations import encode, pack, read_conversations
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
    (cut,) = read_conversations(path, ChatTemplate("t", CHATML), tokenizer, 20, truncate=True)
    assert cut.truncated and len(cut.tokens) == 21


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


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A chat fine-tuning run of 60 steps from a tiny checkpoint without a chat template, and
    the same run's model untrained (one step at a negligible learning rate)."""
    import yaml

    from checkpoints import tiny_checkpoint_with_tokenizer
    from llama_jax.training import finetune, trainer

    root = tmp_path_factory.mktemp("chat")
    pretrained = tiny_checkpoint_with_tokenizer(root / "lm")
    tree = {"init_from": str(pretrained),
            "task": {"kind": "chat", "train": chats(root / "train.jsonl", 96, 0),
                     "val": chats(root / "val.jsonl", 16, 1)},
            "train": {"seq_len": 256, "batch_size": 8, "steps": 60, "learning_rate": 3e-3,
                      "warmup_steps": 5, "log_every": 10, "eval_every": 60,
                      "checkpoint_every": 60}}
    (root / "chat.yaml").write_text(yaml.safe_dump(tree))
    run = finetune.load_run_config(root / "chat.yaml")
    logged = []
    untrained = trainer.train(dataclasses.replace(run, train=dataclasses.replace(
        run.train, steps=1, learning_rate=1e-9, warmup_steps=0, eval_every=1)),
        root / "untrained", log=logged.append, progress=False)
    outcome = trainer.train(run, root / "run", log=logged.append, progress=False)
    return run, root, outcome, untrained, logged


def test_a_chat_run_learns_its_conversations_and_keeps_its_format(chat_run):
    """`task: {kind: chat}` from a checkpoint without a chat template: the run learns the
    answers (validation loss on the assistant's tokens far below the untrained model's), and
    its workdir keeps the ChatML template it was trained in and the tokenizer, so a
    checkpoint of it chats in that format."""
    from llama_jax.data.chat_template import load_chat_template

    run, root, outcome, untrained, logged = chat_run
    assert run.model.head == "lm" and run.task.packing and not run.task.truncate
    assert any("task chat (ChatML" in line and "96 training conversations" in line
               for line in logged), logged
    assert outcome.val_loss < 0.6 * untrained.val_loss, (outcome.val_loss, untrained.val_loss)
    assert "<|im_start|>" in load_chat_template(root / "run").text
    assert (root / "run" / "tokenizer.model").is_file()


def test_a_chat_run_resumes_exactly(chat_run):
    """Stopped at step 30 and resumed: the same parameters as the run that went on."""
    import chex

    from llama_jax.training import trainer

    run, root, _, _, _ = chat_run
    first = trainer.train(run, root / "resumed", stop_at=30, log=lambda _: None,
                          progress=False)
    assert first.stopped_by == "stop_at"
    trainer.train(run, root / "resumed", log=lambda _: None, progress=False)
    chex.assert_trees_all_equal(llama_jax.load_checkpoint(root / "resumed")[1],
                                llama_jax.load_checkpoint(root / "run")[1])


def test_a_bad_chat_file_stops_the_run_before_its_tokenizer_and_template_are_kept(chat_run,
                                                                                  tmp_path):
    from llama_jax.training import trainer

    run = chat_run[0]
    bad = write(tmp_path / "bad.jsonl", [{"messages": MESSAGES}, {"messages": [
        {"role": "user", "content": "x"}]}])
    run = dataclasses.replace(run, task=dataclasses.replace(run.task, train=bad))
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no assistant turn"):
        trainer.train(run, tmp_path / "run", log=lambda _: None, progress=False)
    assert not (tmp_path / "run" / "tokenizer.model").exists()
    assert not (tmp_path / "run" / "chat_template.jinja").exists()
