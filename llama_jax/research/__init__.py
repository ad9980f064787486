"""Research workflows built on the library: ablation studies of config variants and seeds —
study files (`study.py`), the resumable runner (`runner.py`), results tables and plots
(`report.py`), their command line (`ablate.py`) — and the demo downstream task on the Python
docs (`doc_task.py`)."""
