"""Research workflows built on the library: ablation studies of config variants and seeds with
tables and plots (`ablate.py`), and the demo downstream task on the Python docs (`doc_task.py`)."""
