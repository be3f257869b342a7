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


def test_as_8bit_keeps_the_weights_and_the_outputs_bit_for_bit(load):
    """--against-8bit times 6-bit codes against the same weights stored in 8 bits: the same module."""
    import torch

    from runtime.blockq import BlockQuantLinear
    from runtime.kernels import cpu_blockq

    script = load("step_ceiling")
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 64, (64, 256), generator=g, dtype=torch.uint8)
    sc = torch.randint(-20, 64, (64, 16), generator=g).to(torch.int8)
    d = torch.rand(64, 1, generator=g) * 1e-3
    six = BlockQuantLinear.from_canonical(q, sc, sc, d, 32 * d, 6, 16, 256)
    eight = script.as_8bit(six)
    assert (six.bits, eight.bits) == (6, 8) and eight.nbytes() > six.nbytes()
    assert torch.equal(eight.dequantize(), six.dequantize())
    if cpu_blockq.available():
        x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
        assert torch.equal(eight(x), six(x))
    assert script.as_8bit(eight) is eight


def test_against_names_a_kernel_build_or_fails_in_one_line(load, tmp_path):
    """--against takes another checkout's kernel build directory (as attention_rows.py's): a directory
    without the library, or not named as a build, is one line before any model loads."""
    script = load("step_ceiling")
    with pytest.raises(SystemExit, match=r"--against: no specdec_cpu_blockq.so in"):
        script.main(["--against", str(tmp_path / "cpu_blockq-0123456789abcdef-x")])
    odd = tmp_path / "elsewhere"
    odd.mkdir()
    (odd / "specdec_cpu_blockq.so").write_bytes(b"")
    with pytest.raises(SystemExit, match="is not a kernel build directory"):
        script.main(["--against", str(odd)])
