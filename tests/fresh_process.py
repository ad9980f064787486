"""Checks that run in a fresh Python process: a test file that registers a component kind (it
stays registered, and would otherwise be a choice in the other tests' configs) runs itself as
a script, which prints "ok" when every check passed."""

import subprocess
import sys


def passes_alone(script: str) -> None:
    result = subprocess.run([sys.executable, script], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        result.stdout[-2000:] + result.stderr[-3000:])
