"""The `specdec` command line: bad input is one error line and exit status 2, not a traceback."""

import pytest

from specdec.cli import main


def test_bad_options_report_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    argv = ["eval", "--out", str(tmp_path), "--dataset", "sharegpt", "--methods", "plain", "--draft-vocab", "1000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("specdec eval: error: draft_vocab must be 0 (the full vocabulary) or a multiple "
                           "of 16, got 1000")
    assert main(["eval", "--out", str(tmp_path), "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    with pytest.raises(ValueError, match="draft_vocab"):
        main(argv)


def test_unexpected_errors_are_one_line_too(tmp_path, capsys, monkeypatch):
    """An error specdec did not foresee still ends as one line naming its type, exit status 2."""
    import specdec.cli

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)

    def broken(args):
        raise KeyError("num_heads")

    parser = specdec.cli.build_parser()
    monkeypatch.setattr(specdec.cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["fetch"].set_defaults(func=broken)
    assert main(["fetch", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specdec fetch: error: KeyError: 'num_heads' (SPECDEC_DEBUG=1 shows the traceback)"]


# (subcommand argv with its required options, flag, bad value, the error after "argument FLAG: ")
NUMBERS = [
    (["eagle", "data", "--target", "T", "--out", "O.jsonl"], "--max-minutes", "-1", "must be > 0, got -1.0"),
    (["eagle", "data", "--target", "T", "--out", "O.jsonl"], "--max-minutes", "0", "must be > 0, got 0.0"),
    (["eagle", "data", "--target", "T", "--out", "O.jsonl"], "--max-prompt-tokens", "0", "must be >= 1, got 0"),
    (["eagle", "data", "--target", "T", "--out", "O.jsonl"], "--num-prompts", "-5", "must be >= 1, got -5"),
    (["eagle", "data", "--target", "T", "--out", "O.jsonl"], "--batch-size", "0", "must be >= 1, got 0"),
    (["eagle", "data", "--target", "T", "--out", "O.jsonl"], "--max-new-tokens", "0", "must be >= 1, got 0"),
    (["eagle", "data", "--target", "T", "--out", "O.jsonl"], "--temperature", "-0.5", "must be >= 0, got -0.5"),
    (["eagle", "data", "--target", "T", "--out", "O.jsonl"], "--heldout-every", "1", "must be >= 2, got 1"),
    (["eagle", "data", "--target", "T", "--out", "O.jsonl"], "--max-minutes", "nan", "expected a finite number, "
                                                                                      "got 'nan'"),
    (["eagle", "train", "--target", "T", "--data", "D", "--out", "O"], "--dataset-answers", "-1",
     "must be >= 0, got -1"),
    (["eagle", "train", "--target", "T", "--data", "D", "--out", "O"], "--dataset-answer-tokens", "0",
     "must be >= 1, got 0"),
    (["eagle", "train", "--target", "T", "--data", "D", "--out", "O"], "--max-minutes", "-3", "must be > 0, got -3.0"),
    (["medusa", "data", "--model", "M", "--out", "O.jsonl"], "--num-heads", "0", "must be >= 1, got 0"),
    (["medusa", "data", "--model", "M", "--out", "O.jsonl"], "--max-minutes", "0", "must be > 0, got 0.0"),
    (["medusa", "train", "--model", "M", "--data", "D", "--out", "O"], "--num-layers", "0", "must be >= 1, got 0"),
    (["medusa", "train", "--model", "M", "--data", "D", "--out", "O"], "--num-heads", "-1", "must be >= 1, got -1"),
    (["distill", "draft", "--target", "T", "--draft", "D", "--out", "O"], "--num-prompts", "0", "must be >= 1, got 0"),
    (["distill", "draft", "--target", "T", "--draft", "D", "--out", "O"], "--max-prompt-tokens", "-1",
     "must be >= 1, got -1"),
    (["distill", "draft", "--target", "T", "--draft", "D", "--out", "O"], "--heldout-prompts", "-1",
     "must be >= 0, got -1"),
    (["distill", "draft", "--target", "T", "--draft", "D", "--out", "O"], "--code-share", "1", "must be in [0, 1), "
                                                                                               "got 1"),
    (["distill", "recover", "--student", "S", "--teacher", "T", "--out", "O"], "--n-train", "0", "must be >= 1, got 0"),
    (["distill", "recover", "--student", "S", "--teacher", "T", "--out", "O"], "--seq-len", "1", "must be >= 2, got 1"),
    (["distill", "recover", "--student", "S", "--teacher", "T", "--out", "O"], "--heldout", "0", "must be >= 1, got 0"),
    (["generate", "--prompt", "P"], "--max-new-tokens", "0", "must be >= 1, got 0"),
    (["generate", "--prompt", "P"], "--top-p", "0", "must be in (0, 1], got 0.0"),
    (["generate", "--prompt", "P"], "--temperature", "-1", "must be >= 0, got -1.0"),
    (["generate", "--prompt", "P"], "--top-k", "-2", "must be >= 0, got -2"),
    (["generate", "--prompt", "P"], "--eagle-depth", "0", "must be >= 1, got 0"),
    (["serve"], "--max-batch", "0", "must be >= 1, got 0"),
    (["serve"], "--max-len", "-8", "must be >= 1, got -8"),
    (["serve"], "--port", "70000", "must be in [0, 65535], got 70000"),
    (["serve"], "--eagle-top-k", "0", "must be >= 1, got 0"),
    (["demo"], "--limit", "0", "must be >= 1, got 0"),
    (["compress", "--model", "M", "--recipe", "R", "--out", "O"], "--calib-samples", "-1", "must be >= 1, got -1"),
    (["compress", "--model", "M", "--recipe", "R", "--out", "O"], "--seq-len", "0", "must be >= 2, got 0"),
]


@pytest.mark.parametrize("argv, flag, value, message", NUMBERS, ids=[f"{' '.join(a[:2])} {f} {v}"
                                                                     for a, f, v, _ in NUMBERS])
def test_counts_sizes_and_durations_are_checked_while_parsing(tmp_path, capsys, monkeypatch, argv, flag, value,
                                                              message):
    """A count, size or duration that means nothing (0 or negative) fails as argparse's one error line
    and exit status 2, before anything runs (they used to run: `eagle data --max-minutes -1` wrote no
    records and exited 0)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([*argv, flag, value])
    assert exit_.value.code == 2
    command = " ".join(a for a in argv if not a.startswith("-") and a[0].islower())
    assert capsys.readouterr().err.splitlines()[-1] == f"specdec {command}: error: argument {flag}: {message}"
    assert list(tmp_path.iterdir()) == []


def test_eagle_data_with_a_negative_budget_exits_2_without_a_traceback(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "eagle", "data", "--target", str(tmp_path / "none"),
                           "--out", str(tmp_path / "sd.jsonl"), "--max-minutes", "-1"], capture_output=True,
                          text=True, cwd=root, env={**os.environ, "SPECDEC_DEBUG": ""}, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == "specdec eagle data: error: argument --max-minutes: must be > 0, got -1.0"
    assert list(tmp_path.iterdir()) == []
