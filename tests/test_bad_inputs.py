"""A sweep of bad inputs through the command line, each in its own process, and through the Python
API: every command ends with exit status 2 and one line `specdec CMD: error: ...`, no traceback;
every API call raises SpecdecError / ValueError / TypeError with one line naming the argument or
path; and no file changes anywhere under the checkpoints' root (the output paths included, since
each is refused). Faults under load through HTTP: tests/specdec/serving/test_server_faults.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import quant
import runtime
import specdec
from runtime.gguf import convert_gguf
from runtime.output_paths import OutputPathError

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
    (root / "typo.yaml").write_text("steps:\n  - {type: Int8WeightOnly, include_lmhead: true}\n")
    return {"good": good, "remote": variant("remote", auto_map={"AutoModelForCausalLM": "x.Model"}),
            "layers": variant("layers", num_hidden_layers=100_000),
            "positions": variant("positions", max_position_embeddings=10 ** 12),
            "nan": nan, "other_vocab": root / "other_vocab", "root": root}


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
    "temperature": (["generate", "--model", "{good}", "--prompt", "a", "--temperature", "nan"],
                    "argument --temperature: expected a finite number"),
    "too long": (["generate", "--model", "{good}", "--prompt", "a", "--max-new-tokens", "100000"], "prompt ("),
    "draft length": (["generate", "--model", "{good}", "--prompt", "a", "--num-draft-tokens", "0"], "argument"),
    "draft without a tokenizer": (["generate", "--model", "{good}", "--prompt", "a", "--draft", "{other_vocab}"],
                                   "no usable tokenizer in {other_vocab}: it holds none of tokenizer.json"),
    "compress into a file": (["compress", "--model", "{good}", "--recipe", "recipes/quant_int8.yaml", "--out",
                              "{root}/user/notes.txt"], "{root}/user/notes.txt exists and is not a directory"),
    "compress into a user dir": (["compress", "--model", "{good}", "--recipe", "recipes/quant_int8.yaml", "--out",
                                  "{root}/user"], "{root}/user is a non-empty directory that specdec did not write"),
    "eval into a file": (["eval", "--out", "{root}/user/notes.txt", "--target", "{good}", "--dataset", "humaneval",
                          "--methods", "plain"], "{root}/user/notes.txt exists and is not a directory"),
    "empty drafter in a chain": (["generate", "--model", "{good}", "--prompt", "a", "--draft", "ngram+"],
                                 "'ngram+' has an empty drafter after its last '+'"),
    "draft length missing": (["eval", "--out", "{root}/run", "--target", "{good}", "--dataset", "humaneval",
                              "--methods", "ngram@"], "'ngram@' ends in '@' with nothing after it"),
    "negative budget": (["eagle", "data", "--target", "{good}", "--out", "{root}/sd.jsonl", "--max-minutes", "-1"],
                        "argument --max-minutes: must be > 0, got -1.0"),
    "no prompt tokens": (["eagle", "data", "--target", "{good}", "--out", "{root}/sd.jsonl",
                          "--max-prompt-tokens", "0"], "argument --max-prompt-tokens: must be >= 1, got 0"),
    "negative calibration": (["compress", "--model", "{good}", "--recipe", "recipes/quant_int8.yaml", "--out",
                              "{root}/q", "--calib-samples", "-1"], "argument --calib-samples: must be >= 1, got -1"),
    "unknown recipe key": (["compress", "--model", "{good}", "--recipe", "{root}/typo.yaml", "--out", "{root}/q"],
                           "recipe {root}/typo.yaml: step 1: Int8WeightOnly: unknown key 'include_lmhead'"),
    "missing draft": (["distill", "draft", "--target", "{good}", "--draft", "{root}/nowhere", "--out", "{root}/d"],
                      "--draft: '{root}/nowhere' does not exist"),
    "head over a model": (["eagle", "train", "--target", "{good}", "--data", "{root}/sd.jsonl", "--out", "{good}"],
                          "{good} is a non-empty directory that specdec did not write"),
    "compress into an empty path": (["compress", "--model", "{good}", "--recipe", "recipes/quant_int8.yaml", "--out",
                                     ""], "argument --out: an empty path; give a file or directory path"),
    "bench into an empty path": (["bench", "--json", ""], "an empty path is not an output location for the bench "
                                                          "result JSON"),
    "server batch": (["serve", "--model", "{good}", "--max-batch", "0"], "argument --max-batch: must be >= 1, got 0"),
}
NESTED = ("eagle", "medusa", "distill")  # commands whose error line names their subcommand too


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_through_the_cli_is_one_line_and_changes_nothing(checkpoints, tmp_path, case, snapshot):
    argv, start = CASES[case]
    paths = {k: str(v) for k, v in checkpoints.items()}
    user = checkpoints["root"] / "user"
    user.mkdir(exist_ok=True)
    (user / "notes.txt").write_text("the user's own file\n")
    before = snapshot(checkpoints["root"])
    result = _cli(*[a.format(**paths) for a in argv], cwd=REPO)
    command = " ".join(argv[:2]) if argv[0] in NESTED else argv[0]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"specdec {command}: error: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith(f"specdec {command}: error: {start.format(**paths)}"), errors[0]
    after = snapshot(checkpoints["root"])
    assert after == before  # nothing was written, moved or deleted (the cache lives elsewhere)


API_CASES = {  # name -> (call(model, paths), exception type, the start of its message)
    "max_new_tokens float": (lambda m, p: specdec.generate(m, IDS, max_new_tokens=2.5), TypeError,
                             "max_new_tokens must be an integer >= 1, got 2.5 (float)"),
    "max_new_tokens text": (lambda m, p: specdec.generate(m, IDS, max_new_tokens="8"), TypeError,
                            "max_new_tokens must be an integer >= 1, got '8' (str)"),
    "a path as the model": (lambda m, p: specdec.generate(p["good"], IDS), TypeError,
                            "target must be a loaded model, got the path or name '{good}'"),
    "streamer": (lambda m, p: specdec.generate(m, IDS, streamer=object()), TypeError,
                 "streamer must be a transformers-style streamer"),
    "generator": (lambda m, p: specdec.generate(m, IDS, generator=42), TypeError,
                  "generator must be a torch.Generator or None, got 42 (int)"),
    "meta inputs": (lambda m, p: specdec.generate(m, IDS.to("meta")), ValueError,
                    "input_ids is on the meta device"),
    "pads without a mask": (lambda m, p: specdec.generate(m, torch.tensor([[5, 6, 0, 0]]), pad_token_id=0),
                            ValueError, "input_ids row 0 starts or ends with pad_token_id 0"),
    "chain spec": (lambda m, p: specdec.generate(m, IDS, draft="ngram+"), ValueError,
                   "'ngram+' has an empty drafter after its last '+'"),
    "int8 dtype": (lambda m, p: runtime.load_model(p["good"], dtype=torch.int8), ValueError,
                   "dtype must be one of torch.bfloat16, torch.float32, torch.float16"),
    "head over a model": (lambda m, p: specdec.save_eagle(_head(m), p["good"]), OutputPathError,
                          "{good} is a non-empty directory that specdec did not write"),
    "checkpoint under /dev/null": (lambda m, p: quant.save_compressed(m, "/dev/null/x"), OutputPathError,
                                   "/dev/null/x cannot be created for the compressed checkpoint"),
}
IDS = torch.tensor([[1, 2, 3]])


def _head(model) -> specdec.Eagle3Head:
    return specdec.Eagle3Head(specdec.Eagle3Config.from_target(model, aux_layers=(0, 1, 1)))


@pytest.mark.parametrize("case", list(API_CASES))
def test_bad_input_through_the_api_names_it_in_one_line_and_changes_nothing(checkpoints, case, snapshot):
    call, kind, start = API_CASES[case]
    paths = {k: str(v) for k, v in checkpoints.items()}
    model = runtime.load_model(checkpoints["good"], dtype=torch.float32)
    before = snapshot(checkpoints["root"])
    with pytest.raises(kind) as err:
        call(model, paths)
    text = str(err.value)
    assert len(text.splitlines()) == 1 and text.startswith(start.format(**paths)), text
    assert snapshot(checkpoints["root"]) == before
