"""A sweep of bad inputs through the command line, each in its own process: every one ends with
exit status 2 and one line `specdec CMD: error: ...`, no traceback, and no file outside the
output path changes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from runtime.gguf import convert_gguf

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_llama, tiny_qwen2, gguf_writer):
    """A good tiny checkpoint with a tokenizer, and broken copies of it."""
    root = tmp_path_factory.mktemp("bad_inputs")
    gguf_writer(tiny_llama, root / "tiny.gguf")
    good = convert_gguf(root / "tiny.gguf", root / "good", progress=False)

    def variant(name: str, **config) -> Path:
        path = shutil.copytree(good, root / name)
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config}))
        return path

    nan = variant("nan")
    weights = load_file(str(nan / "model.safetensors"))
    next(t for k, t in weights.items() if k.endswith("mlp.down_proj.weight"))[0, 0] = float("nan")
    save_file(weights, str(nan / "model.safetensors"), metadata={"format": "pt"})
    tiny_qwen2.save_pretrained(root / "other_vocab")
    return {"good": good, "remote": variant("remote", auto_map={"AutoModelForCausalLM": "x.Model"}),
            "layers": variant("layers", num_hidden_layers=100_000),
            "positions": variant("positions", max_position_embeddings=10 ** 12),
            "nan": nan, "other_vocab": root / "other_vocab", "root": root}


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_DEBUG"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


CASES = {  # name -> (argv with {placeholders}, the start of the error text after "error: ")
    "remote code": (["generate", "--model", "{remote}", "--prompt", "a"],
                    "{remote}/config.json has an 'auto_map' entry"),
    "layer count": (["generate", "--model", "{layers}", "--prompt", "a"],
                    "{layers}/config.json says num_hidden_layers"),
    "positions": (["generate", "--model", "{positions}", "--prompt", "a"], "{positions}/config.json is invalid"),
    "nan weights": (["generate", "--model", "{nan}", "--prompt", "a"], "tensor layers.0.mlp.w2.weight holds NaN"),
    "missing model": (["generate", "--model", "{root}/nowhere", "--prompt", "a"], "'{root}/nowhere' does not exist"),
    "device": (["generate", "--model", "{good}", "--prompt", "a", "--device", "banana"], "unknown device"),
    "temperature": (["generate", "--model", "{good}", "--prompt", "a", "--temperature", "nan"], "temperature"),
    "too long": (["generate", "--model", "{good}", "--prompt", "a", "--max-new-tokens", "100000"], "prompt ("),
    "draft length": (["generate", "--model", "{good}", "--prompt", "a", "--num-draft-tokens", "0"], "argument"),
    "vocabulary": (["generate", "--model", "{good}", "--prompt", "a", "--draft", "{other_vocab}"],
                   "draft and target tokenizers disagree"),
    "compress into a file": (["compress", "--model", "{good}", "--recipe", "recipes/quant_int8.yaml", "--out",
                              "{root}/user/notes.txt"], "{root}/user/notes.txt exists and is not a directory"),
    "compress into a user dir": (["compress", "--model", "{good}", "--recipe", "recipes/quant_int8.yaml", "--out",
                                  "{root}/user"], "{root}/user is a non-empty directory that specdec did not write"),
    "eval into a file": (["eval", "--out", "{root}/user/notes.txt", "--target", "{good}", "--dataset", "humaneval",
                          "--methods", "plain"], "{root}/user/notes.txt exists and is not a directory"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_through_the_cli_is_one_line_and_changes_nothing(checkpoints, tmp_path, case):
    argv, start = CASES[case]
    paths = {k: str(v) for k, v in checkpoints.items()}
    user = checkpoints["root"] / "user"
    user.mkdir(exist_ok=True)
    (user / "notes.txt").write_text("the user's own file\n")
    before = _snapshot(checkpoints["root"])
    result = _cli(*[a.format(**paths) for a in argv], cwd=REPO)
    command = argv[0]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"specdec {command}: error: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith(f"specdec {command}: error: {start.format(**paths)}"), errors[0]
    after = _snapshot(checkpoints["root"])
    assert after == before  # nothing was written, moved or deleted (the cache lives elsewhere)
