"""Zero-shot evaluation: log-likelihood scoring and perplexity of token sequences (scoring.py)
and an EleutherAI lm-evaluation-harness model adapter built on it (harness.py)."""
