"""Evaluation: log-likelihood scoring and perplexity of token sequences (`scoring.py`), an
EleutherAI lm-evaluation-harness model built on them (`harness.py`), and task heads' predictions
and metrics on a JSONL file (`predict.py`)."""
