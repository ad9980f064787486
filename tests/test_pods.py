"""The planner checked against XLA:TPU at pod scale (`make test-pods`, minutes a row; left out of
`make test`): each row of bench/pods.py (LLaMA-3 8B / 70B / 405B, Mixtral on an expert axis, an
MLA model, on v5p slices) compiled on this CPU for its slice. The planner's verdict must be
XLA:TPU's, and its bytes per chip within 0.8-1.1x of XLA's peak: the plan counts the logits'
gradient, which XLA:TPU writes at 32K tokens a chip but fuses into the head's matmuls at 8K
(LLaMA-3 70B at 8K: 0.81)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import pods  # noqa: E402

pytestmark = pytest.mark.pods


@pytest.mark.parametrize("row", list(pods.ROWS))
def test_the_planner_agrees_with_xla_tpu(row):
    result = pods.run_row(row)
    assert "failed" not in result, result.get("failed")
    assert result["planned_fits"] == result["xla_fits"], result
    assert 0.8 <= result["xla_peak"] / result["planned"] <= 1.1, result
