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
    (["eval", "--out", "O", "--prompts", "P.jsonl"], "--seed", "-5", "must be in [0, 9223372036854775807], got -5"),
    (["medusa", "data", "--model", "M", "--out", "O.jsonl"], "--seed", "-1", "must be in [0, 9223372036854775807], "
                                                                             "got -1"),
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


# (argv, the error after "specdec CMD: error: "): options that used to be dropped or run something else
REFUSED = [
    (["generate", "--prompt", "P", "--draft", ""], "--draft is empty; pass a drafter spec (e.g. ngram or "
     "draft:NAME_OR_PATH), or omit --draft for plain decoding"),
    (["generate", "--prompt", "P", "--draft", "  "], "--draft is empty"),
    (["generate", "--prompt", "P", "--eagle", ""], "--eagle is empty; pass an EAGLE-3 head directory"),
    (["generate", "--prompt", "P", "--medusa", ""], "--medusa is empty; pass a Medusa heads directory"),
    (["generate", "--prompt", "P", "--eagle-tree", "8"], "--eagle-tree only applies with --eagle; add --eagle PATH "
     "(an EAGLE-3 head), or drop --eagle-tree"),
    (["generate", "--prompt", "P", "--eagle-depth", "3", "--eagle-top-k", "2"], "--eagle-depth, --eagle-top-k only "
     "apply with --eagle; add --eagle PATH (an EAGLE-3 head), or drop --eagle-depth and --eagle-top-k"),
    (["generate", "--prompt", "P", "--draft", "ngram", "--eagle-top-k", "2"],
     "--eagle-top-k only applies with --eagle"),
    (["generate", "--prompt", "P", "--draft", "eagle:heads", "--eagle-depth", "3"], "--eagle-depth only applies with "
     "--eagle; write the tree in the --draft spec instead (eagle:DIR@N:DEPTHxTOP_K), or drop --eagle-depth"),
    (["serve", "--port", "0", "--draft", ""], "--draft is empty; pass a drafter spec"),
    (["serve", "--port", "0", "--eagle-tree", "8"], "--eagle-tree only applies with --eagle"),
    (["fetch", ""], "the catalogue name is empty; pass one (specdec fetch --list lists them)"),
    (["fetch", "--list", "extra"], "--list takes no name, got 'extra'; run `specdec fetch --list` alone, or "
     "`specdec fetch extra` to download it"),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_dropped_drafter_and_fetch_options_are_refused(tmp_path, capsys, monkeypatch, argv, message):
    """Refused before any model loads or downloads (SPECDEC_HOME points at an empty directory)."""
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"specdec {argv[0]}: error: {message}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value, message", [("99999999999999999999999", "must be in [0, 9223372036854775807], got "
                                                                          "99999999999999999999999"),
                                            ("-1", "must be in [0, 9223372036854775807], got -1"),
                                            ("1.5", "expected an integer, got '1.5'")])
def test_generate_seeds_outside_what_a_generator_takes_fail_while_parsing(capsys, value, message):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "P", "--seed", value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"specdec generate: error: argument --seed: {message}"


@pytest.mark.parametrize("flag", ["--matvec-size", "--stream-mib"])
def test_bench_probes_larger_than_free_memory_are_refused_before_loading(tmp_path, capsys, monkeypatch, flag):
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert main(["bench", "--model", str(tmp_path / "none"), flag, "99999999"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    default = 8192 if flag == "--matvec-size" else 1024
    assert err.startswith(f"specdec bench: error: {flag} 99999999 needs ")
    assert err.endswith(f"lower {flag} (default: {default})")
    assert "GiB for its bandwidth probe, but cpu has " in err


def test_demo_checks_its_output_path_before_fetching(tmp_path, capsys, monkeypatch):
    import runtime

    def no_fetch(name):
        raise AssertionError(f"fetched {name} before checking --out")

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    monkeypatch.setattr(runtime, "fetch", no_fetch)
    (tmp_path / "file").write_text("mine")
    for out, message in [(tmp_path / "file", "exists and is not a directory"),
                         ("/proc/x", "/proc/x cannot be created for the evaluation run")]:
        assert main(["demo", "--out", str(out)]) == 2
        err = capsys.readouterr().err.splitlines()[-1]
        assert err.startswith("specdec demo: error: ") and message in err, err
    assert (tmp_path / "file").read_text() == "mine"


_CTRL_C_AT_IMPORT = """
import os, signal, sys

# a terminal's Ctrl-C: the test process may have left SIGINT ignored, which a child inherits
signal.signal(signal.SIGINT, signal.default_int_handler)


class CtrlC:  # Ctrl-C at the moment the command starts importing {module}
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, CtrlC())
from specdec.cli import main  # what the console script runs

sys.exit(main(["fetch", "--list"]))
"""


@pytest.mark.parametrize("module", ["torch", "runtime.catalogue"])
def test_ctrl_c_while_the_command_imports_is_one_line_and_status_130(module):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _CTRL_C_AT_IMPORT.format(module=module)], capture_output=True,
                         text=True, timeout=300)
    assert (run.returncode, run.stderr) == (130, "interrupted\n"), run.stderr[-2000:]


def test_the_entry_point_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, specdec, specdec.cli; print(sorted({'torch', 'runtime', 'transformers'} & set(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "[]", run.stderr
