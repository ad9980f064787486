"""Data: tokenizers (`tokenizer.py`: SentencePiece and LLaMA-3's tiktoken), text corpora
tokenized once into cached arrays (`corpus.py`), prepared token shards built on many cores and
hosts from text, JSONL and Parquet (`prepare.py`), packed and shuffled training batches whose
iterator state is checkpointed (`batches.py`), and downstream-task datasets (`tasks.py`)."""
