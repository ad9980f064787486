"""Training metrics: JSON lines (`metrics.jsonl`) and TensorBoard event files.

Every record carries `step`; non-finite values are written as null (JSON has no NaN). On resume
the log is cut back to the restored step first, so the file always reads like one uninterrupted
run. Only process 0 writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax

from llama_jax.files import write_atomically


class MetricsLog:
    def __init__(self, jsonl: Path, tensorboard_dir: Path, resume_step: int):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        truncate_after(jsonl, resume_step)
        self._file = jsonl.open("a")
        from tensorboardX import SummaryWriter

        # purge_step hides events a previous, interrupted run logged past the resume point.
        self._tensorboard = SummaryWriter(str(tensorboard_dir), purge_step=resume_step + 1)

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in values.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        for name, value in clean.items():
            if value is not None:
                self._tensorboard.add_scalar(name, value, step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tensorboard.close()


def truncate_after(jsonl: Path, step: int) -> None:
    """Drops the records past `step` (written after the checkpoint a run resumes from)."""
    if not jsonl.is_file():
        return
    kept = [line for line in jsonl.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line)["step"] <= step]
    write_atomically(jsonl, "".join(kept))


def read(jsonl: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
