"""quant.load_recipe reading the file: duplicate keys, a directory, a binary or unreadable file and YAML
syntax errors are refused in one line naming the file (and the line); `specdec compress` shows that line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quant.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, want", [
    ("steps:\n  - {type: NF4}\nsteps:\n  - {type: Int8WeightOnly}\n",
     "line 3, column 1: key 'steps' is written twice (first at line 1); write each key once"),
    ("steps:\n  - {type: NF4, blocksize: 64, blocksize: 128}\n",
     "line 2, column 32: key 'blocksize' is written twice (first at line 2); write each key once"),
    ("calibration: {n_samples: 4}\ncalibration: {n_samples: 8}\nsteps: [{type: NF4}]\n",
     "line 2, column 1: key 'calibration' is written twice (first at line 1); write each key once"),
    ("steps: [\n  - a: 1\n b", "line 2, column 3: expected the node content, but found '-'"),
], ids=["steps", "step-field", "calibration", "syntax"])
def test_a_key_written_twice_and_bad_yaml_are_named_with_the_line(tmp_path, text, want):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(ValueError) as err:
        load_recipe(recipe)
    assert str(err.value) == f"recipe {recipe} is not valid YAML: {want}"


def test_a_key_a_merge_brought_in_may_be_overridden(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps:\n  - &b {type: NF4, blocksize: 64}\n  - {<<: *b, blocksize: 128}\n")
    assert [s.blocksize for s in load_recipe(recipe).steps] == [64, 128]


def test_a_directory_a_binary_file_and_an_unreadable_file_are_named(tmp_path):
    with pytest.raises(ValueError, match=rf"^recipe {tmp_path} is a directory; give the recipe's YAML file$"):
        load_recipe(tmp_path)
    binary = tmp_path / "r.bin"
    binary.write_bytes(b"\xff\xfe\x00\x01steps")
    with pytest.raises(ValueError, match=rf"^recipe {binary} is not a UTF-8 text file \(invalid start byte at byte 0"):
        load_recipe(binary)
    with pytest.raises(FileNotFoundError, match=rf"^recipe {tmp_path / 'none.yaml'} does not exist$"):
        load_recipe(tmp_path / "none.yaml")
    if os.geteuid() != 0:  # root reads a 0o000 file
        locked = tmp_path / "locked.yaml"
        locked.write_text("steps: [{type: NF4}]\n")
        locked.chmod(0)
        with pytest.raises(ValueError, match=rf"^recipe {locked} cannot be read \(Permission denied\)"):
            load_recipe(locked)


def test_compress_names_the_recipe_file_in_one_line(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\x00")
    (tmp_path / "dup.yaml").write_text("steps: [{type: NF4}]\nsteps: [{type: Int8WeightOnly}]\n")
    (tmp_path / "dir").mkdir()
    env = {**os.environ, "SPECDEC_DEBUG": ""}
    for name, want in [("bin.yaml", "is not a UTF-8 text file"), ("dir", "is a directory"),
                       ("dup.yaml", "is not valid YAML: line 2, column 1: key 'steps' is written twice")]:
        proc = subprocess.run([sys.executable, "-m", "specdec.cli", "compress", "--model", str(tmp_path / "none"),
                               "--recipe", str(tmp_path / name), "--out", str(tmp_path / "out")],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"specdec compress: error: recipe {tmp_path / name} {want}"), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin.yaml", "dir", "dup.yaml"]
