"""Conversation files for chat fine-tuning tests (`task: {kind: chat}`)."""

import json

import numpy as np

from checkpoints import TEXT


def write(path, records) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records)
                    + "\n")
    return str(path)


def chats(path, n: int, seed: int) -> str:
    """Conversations whose answer repeats the question's words backwards: learnable, and
    only from the question (the answer's own tokens are what is scored)."""
    rng = np.random.default_rng(seed)
    words = sorted(set(" ".join(TEXT[:3]).replace(".", "").replace(";", "").split()))
    records = []
    for i in range(n):
        asked = list(rng.choice(words, 4))
        records.append({"id": f"{seed}-{i}", "messages": [
            {"role": "user", "content": " ".join(asked)},
            {"role": "assistant", "content": " ".join(asked[::-1])}]})
    return write(path, records)
