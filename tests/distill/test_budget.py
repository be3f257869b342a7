"""RunBudget: a job's wall-clock budget carried across restarts through its progress file."""

import json
import time
from types import SimpleNamespace

import pytest

from distill.budget import RunBudget, run_budgeted


def test_a_restarted_job_goes_on_against_the_same_budget(tmp_path):
    path = tmp_path / "budget.json"
    with RunBudget(path, max_minutes=10) as first:
        assert first.spent_before == 0.0
        assert abs(first.at(0.5) - (first.start + 300)) < 1e-6
    spent = json.loads(path.read_text())["spent_minutes"]
    path.write_text(json.dumps({"spent_minutes": 4.0 + spent}))  # as if the first run had run 4 minutes
    with RunBudget(path, max_minutes=10) as second:
        assert second.spent_before == pytest.approx(4.0 + spent)
        assert second.minutes() >= second.spent_before
        left = second.at(1.0) - time.monotonic()
        assert 60 * (6 - spent) - 1 < left <= 60 * (6 - spent)  # 6 of the 10 minutes are left
    assert json.loads(path.read_text())["spent_minutes"] >= 4.0


def test_the_progress_file_is_rewritten_while_the_job_runs(tmp_path):
    path = tmp_path / "budget.json"
    with RunBudget(path, max_minutes=1, every=0.02):
        first = json.loads(path.read_text())["spent_minutes"]
        time.sleep(0.3)
        assert json.loads(path.read_text())["spent_minutes"] > first  # without close()


def test_bad_budgets_and_progress_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_minutes must be > 0"):
        RunBudget(tmp_path / "b.json", max_minutes=0)
    with pytest.raises(ValueError, match="every must be > 0"):
        RunBudget(tmp_path / "b.json", max_minutes=1, every=0)
    for spent in ("NaN", "-1"):  # NaN would make every deadline unreachable
        (tmp_path / "b.json").write_text('{"spent_minutes": %s}' % spent)
        with pytest.raises(ValueError, match="b.json is not a budget file"):
            RunBudget(tmp_path / "b.json", max_minutes=5)
    (tmp_path / "b.json").write_text('{"minutes": 3}')
    with pytest.raises(ValueError, match="b.json is not a budget file"):
        RunBudget(tmp_path / "b.json", max_minutes=5)


def test_eval_only_needs_the_file_the_recipe_trains(tmp_path):
    """--eval-only checks the recipe's own product file (e.g. the distillation recipe's
    draft/distill_metrics.json), and then runs the steps without a budget."""
    args = SimpleNamespace(out=str(tmp_path / "run"), max_minutes=10.0, data_frac=0.0, train_frac=None,
                           eval_minutes=2.0, threads=0, dtype="float32", eval_only=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "budget.json").write_text('{"spent_minutes": 1.0, "max_minutes": 10.0}')
    with pytest.raises(SystemExit, match="no draft/metrics.json"):
        run_budgeted(args, ("budget.json",), "a test run", "draft", lambda out, budget: {},
                     trained="draft/metrics.json")
    (tmp_path / "run" / "draft").mkdir()
    (tmp_path / "run" / "draft" / "metrics.json").write_text("{}")
    seen = run_budgeted(args, ("budget.json",), "a test run", "draft", lambda out, budget: {"budget": budget},
                        trained="draft/metrics.json")
    assert seen == {"budget": None}
