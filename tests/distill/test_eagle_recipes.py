"""The EAGLE-3 recipes check the evaluated tree before any work: a tree its depth and top-k cannot
hold ends as one error line, before a model is loaded, and writes nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tree,match", [(["--eagle-tree", "48", "--eagle-depth", "3", "--eagle-top-k", "4"],
                                         "exceeds the 36 candidates"),
                                        (["--eagle-tree", "auto", "--eagle-depth", "1", "--eagle-top-k", "1"],
                                         "this shape holds 1"),
                                        (["--eagle-tree", "8", "--eagle-depth", "0"], "depth must be")])
def test_a_tree_the_shape_cannot_hold_fails_before_any_work(tmp_path, tree, match):
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "eagle_smollm2.py"), "--out", str(tmp_path / "run"),
                           *tree], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "SPECDEC_DEBUG": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert match in proc.stderr and not (tmp_path / "run").exists()
