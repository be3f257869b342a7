"""benchmarks/step_ceiling.py: its arguments are checked before any model loads."""

import pytest


@pytest.mark.parametrize("argv, phrase", [
    (["--rows", "abc"], "argument --rows: row counts are integers >= 1 joined by commas (e.g. 1,2,4): expected an "
                        "integer, got 'abc'"),
    (["--rows", "1,,2"], "expected an integer, got ''"),
    (["--rows", "0"], "must be >= 1"),
    (["--repeats", "0"], "argument --repeats"),
    (["--threads", "-2"], "argument --threads"),
])
def test_bad_arguments_are_one_usage_error(load, capsys, argv, phrase):
    """`--rows abc` was a ValueError traceback from int(); `--rows 0` and `--repeats 0` ran (the median of no
    steps)."""
    script = load("step_ceiling")
    with pytest.raises(SystemExit) as done:
        script.main(argv)
    assert done.value.code == 2 and phrase in capsys.readouterr().err
    assert script.row_counts("1, 2,16") == [1, 2, 16]


def test_a_model_that_does_not_load_is_one_line():
    """`--model no-such-model` was a CheckpointError traceback."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "step_ceiling.py"
    proc = subprocess.run([sys.executable, str(script), "--model", "no-such-model"], capture_output=True,
                          text=True, cwd=script.parents[1])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("step_ceiling.py: error: 'no-such-model' does not exist")
