"""benchmarks/attention_rows.py: arguments checked, one table row per shape, a clear error for a build
directory that holds no library."""

import pytest

from runtime.kernels import extension


@pytest.mark.parametrize("argv, phrase", [
    (["--slots", "abc"], "argument --slots: integers joined by commas, got 'abc'"),
    (["--tokens", "0"], "argument --tokens: integers >= 1, got '0'"),
    (["--repeats", "0"], "argument --repeats"),
])
def test_bad_arguments_are_one_usage_error(load, capsys, argv, phrase):
    with pytest.raises(SystemExit) as done:
        load("attention_rows").main(argv)
    assert done.value.code == 2 and phrase in capsys.readouterr().err


@pytest.mark.skipif(not extension.available(), reason="CPU extension not built here")
def test_one_row_per_shape_and_a_missing_build_is_named(load, capsys, tmp_path):
    script = load("attention_rows")
    script.main(["--slots", "40,3", "--tokens", "1,4", "--repeats", "2", "--heads", "4,2", "--dim", "40"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[:2] for r in rows] == [["| 40", "1"], ["| 40", "4"], ["| 3", "1"]]
    with pytest.raises(SystemExit, match="no specdec_cpu_blockq.so in"):
        script.main(["--slots", "40", "--against", str(tmp_path / "cpu_blockq-0123456789abcdef-x")])


@pytest.mark.skipif(not extension.available(), reason="CPU extension not built here")
def test_a_directory_that_is_no_kernel_build_is_named(load, tmp_path):
    """A library in a directory not named as the kernel builds are gave an IndexError traceback; one that
    does not load gave an OSError."""
    script = load("attention_rows")
    odd = tmp_path / "mine"
    odd.mkdir()
    (odd / "specdec_cpu_blockq.so").write_bytes(b"not a library")
    with pytest.raises(SystemExit, match="is not a kernel build directory"):
        script.main(["--slots", "40", "--against", str(odd)])
    build = tmp_path / "cpu_blockq-0123456789abcdef-x"
    build.mkdir()
    (build / "specdec_cpu_blockq.so").write_bytes(b"not a library")
    with pytest.raises(SystemExit, match="cannot load"):
        script.main(["--slots", "40", "--against", str(build)])
