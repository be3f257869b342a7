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
