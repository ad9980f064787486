"""Data: tokenizers (`tokenizer.py`: SentencePiece and LLaMA-3's tiktoken; `json_tokenizer.py`:
tokenizer.json; `gguf_vocab.py`: GGUF vocabularies), chat templates (`chat_template.py`) and
the chat formats built on them (`chat.py`), documents from text,
JSONL and Parquet inputs (`documents.py`), prepared token shards written and opened
(`shards.py`) by `python -m llama_jax.data.prepare` on many cores and hosts (`prepare.py`), a
run's corpus and tokenizer (`corpus.py`), packed, shuffled or mixed training batches whose
position is checkpointed (`batches.py`), and downstream-task datasets (`tasks.py`)."""
