"""The compression recipes check every output path before any work (runtime.output_paths' rule): a bad
--out ends as one line and exit status 2, before a model is loaded, and touches nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"


def _recipe(name: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RECIPES / f"{name}.py"), *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "SPECDEC_DEBUG": ""})


def test_a_recipe_refuses_a_file_as_out_in_one_line(tmp_path):
    (tmp_path / "file").write_text("mine")
    proc = _recipe("quant_qwen05_drafts", "--out", str(tmp_path / "file"), "--skip-eval")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("quant_qwen05_drafts: error: ") and "file exists and is not a directory" in first
    assert (tmp_path / "file").read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.fixture()
def recipes_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(RECIPES))
    import quant_common

    return quant_common


def test_check_outputs_accepts_new_and_earlier_outputs_and_refuses_the_rest(recipes_on_path, tmp_path, snapshot):
    from runtime.output_paths import OutputPathError

    check = recipes_on_path.check_outputs
    ckpt, summary = tmp_path / "int8", tmp_path / "rows.json"
    check(tmp_path, [ckpt], summary, overwrite=False)  # all new
    ckpt.mkdir()
    (ckpt / "compression.json").write_text("{}")
    summary.write_text(json.dumps([{"name": "dense"}]))
    with pytest.raises(OutputPathError, match="already holds a compressed checkpoint.*--overwrite"):
        check(tmp_path, [ckpt], summary, overwrite=False)
    check(tmp_path, [ckpt], summary, overwrite=True)  # an earlier run of the recipe
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    (tmp_path / "notes.json").write_text('{"my": "settings"}')
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError, match="mine is a non-empty directory that specdec did not write"):
        check(tmp_path, [tmp_path / "mine"], summary, overwrite=True)
    with pytest.raises(OutputPathError, match="notes.json exists and is not a recipe summary"):
        check(tmp_path, [ckpt], tmp_path / "notes.json", overwrite=True)
    with pytest.raises(OutputPathError, match="is not a directory"):
        check(tmp_path / "notes.json", [], summary, overwrite=True)
    recipes_on_path.write_summary(summary, [{"name": "int8"}])
    assert json.loads(summary.read_text()) == [{"name": "int8"}]
    assert {k: v for k, v in snapshot(tmp_path).items() if k != "rows.json"} == \
        {k: v for k, v in before.items() if k != "rows.json"}
