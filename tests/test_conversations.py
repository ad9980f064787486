"""Chat data for supervised fine-tuning (data/conversations.py): the assistant's tokens found
in a rendered conversation (against the conversation rendered by hand, and by a template's
`{% generation %}` marks), bad lines named, long conversations refused or cut, and packed rows
that compute, conversation by conversation, what each computes alone."""

import io
import json

import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.data.chat_template import ChatTemplate
from llama_jax.data.conversations import encode, pack, read_conversations
from llama_jax.errors import DataError
from llama_jax.model.transformer import forward

from checkpoints import TEXT
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


def write(path, records) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records)
                    + "\n")
    return str(path)


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
    assert len(single["inputs"]) == 3 and len(packed["inputs"]) < 3
    config = TINY
    params = random_params({"m": config})["m"]

    def logits(rows):
        return np.asarray(forward(config, params, jnp.asarray(rows["inputs"]),
                                  positions_BT=jnp.asarray(rows["positions"]),
                                  segment_ids_BT=jnp.asarray(rows["segment_ids"])))

    packed_logits, single_logits = logits(packed), logits(single)
    row, at, segment = 0, 0, 1
    for i, c in enumerate(conversations):
        n = len(c.tokens) - 1
        if at + n > T:
            row, at, segment = row + 1, 0, 1
        span = slice(at, at + n)
        np.testing.assert_array_equal(packed["targets"][row, span], c.tokens[1:])
        np.testing.assert_array_equal(packed["weights"][row, span], c.assistant[1:])
        np.testing.assert_array_equal(packed["segment_ids"][row, span], segment)
        np.testing.assert_allclose(packed_logits[row, span], single_logits[i, :n],
                                   rtol=2e-5, atol=2e-5)
        at, segment = at + n, segment + 1
    assert packed["weights"][packed["segment_ids"] == 0].sum() == 0
