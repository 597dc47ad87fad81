"""A launch without a cluster fails in one line (a real process: no traceback on stderr). The
bad-input suite runs in-process (`tests/unit/test_bad_inputs.py`); crashes mid-step and
mid-checkpoint, and the automatic restart, are `tests/e2e/test_restarts.py`."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.runs import ROOT


def test_missing_cluster_is_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain.py")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "+cluster=local_cpu" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
