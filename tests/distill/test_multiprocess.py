"""Several processes: Medusa, EAGLE-3 and recovery training under `accelerate launch --multi_gpu
--num_processes 2` (on a machine without GPUs: DDP over gloo) give the losses of one process at the
same global batch.

One job script (JOB) trains all three on tiny models and writes each loop's per-step losses; it runs
once as a plain process and once under accelerate with two processes, each process then taking half
of every global batch. Only the main process may write: the output directories must look alike.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distill.accel import local_part
from distill.data.features import cache_eagle_states, cache_hidden_states
from runtime.tiny import tiny_model

JOB = '''
import copy, json, sys
from pathlib import Path

import torch
import distill
import quant
from distill.accel import close_process_group
from distill.recover.train import RecoverConfig
from distill.eagle.train import EagleTrainConfig
from distill.medusa.train import MedusaTrainConfig
from runtime.tiny import tiny_model

torch.set_num_threads(1)
out, medusa_cache, eagle_cache = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
model = tiny_model("llama", seed=0)
distill.train_medusa(distill.attach_medusa(model, num_heads=2), medusa_cache, out / "medusa",
                     MedusaTrainConfig(epochs=1, lr=1e-2, batch_size=64, warmup_steps=2, mixed_precision="no"))

target = tiny_model("llama", seed=0, num_hidden_layers=4)
with torch.no_grad():
    target.lm_head.weight.mul_(30)
distill.train_eagle(target, eagle_cache, EagleTrainConfig(
    epochs=1, draft_vocab_size=96, aux_layers="1,2,3", lr=3e-3, batch_tokens=256, warmup_steps=2,
    mixed_precision="no"), out / "eagle")

teacher = tiny_model("llama", seed=3)
with torch.no_grad():
    for p in teacher.parameters():
        if p.dim() == 2:
            p.mul_(8.0)
student = quant.sparsify_(copy.deepcopy(teacher), quant.SemiStructured24(method="magnitude"), progress=False)
windows = torch.randint(0, 128, (32, 24), generator=torch.Generator().manual_seed(0))
distill.recover(student, teacher, windows, RecoverConfig(steps=6, batch_size=8, micro_batch=2, lr=1e-2,
                warmup_steps=2, mixed_precision="no"), out / "recover")
close_process_group()  # as the CLI and the recipes end: gloo's threads stop before the interpreter
'''

V = 128


def _records(n: int, seed: int) -> list[dict]:
    """Answers that walk a fixed permutation of the vocabulary after a random prompt."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(V, generator=g)
    out = []
    for i in range(n):
        prompt = torch.randint(0, V, (int(torch.randint(2, 8, (), generator=g)),), generator=g).tolist()
        x, answer = int(torch.randint(0, V, (), generator=g)), []
        for _ in range(int(torch.randint(10, 30, (), generator=g))):
            answer.append(x)
            x = int(perm[x])
        out.append({"id": i, "prompt_ids": prompt, "output_ids": answer})
    return out


def _losses(out: Path) -> dict[str, list[float]]:
    files = {"medusa": "medusa/checkpoint/trainer.json", "eagle": "eagle/checkpoint/eagle_trainer.json",
             "recover": "recover/checkpoint/recover_trainer.json"}
    return {k: json.loads((out / f).read_text())["losses"] for k, f in files.items()}


def _files(out: Path) -> set[str]:
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate command")
def test_two_cpu_processes_match_one_at_the_same_global_batch(tmp_path):
    medusa = cache_hidden_states(tiny_model("llama", seed=0), _records(24, 0), tmp_path / "medusa_cache",
                                 num_heads=2, dtype=torch.float32)
    target = tiny_model("llama", seed=0, num_hidden_layers=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(30)
    eagle = cache_eagle_states(target, _records(24, 1), tmp_path / "eagle_cache", (1, 2, 3), heldout_every=6,
                               dtype=torch.float32)
    job = tmp_path / "job.py"
    job.write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    args = [str(medusa), str(eagle)]
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([sys.executable, str(job), str(one), *args], check=True, env=env, timeout=300)
    launch = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517"]
    run = subprocess.run([*launch, str(job), str(two), *args], env=env, timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads((two / "recover" / "metrics.json").read_text())["processes"] == 2
    a, b = _losses(one), _losses(two)
    for loop in a:
        assert len(a[loop]) == len(b[loop]) > 2, loop
        assert a[loop][-1] < a[loop][0], loop  # it learned something: the comparison is not of constants
        torch.testing.assert_close(torch.tensor(b[loop]), torch.tensor(a[loop]), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, loop=loop: f"{loop}: {m}")
    assert _files(one) == _files(two)  # the second process wrote nothing of its own


@pytest.mark.parametrize("n, world", [(8, 2), (7, 3), (2, 4)])
def test_local_parts_cover_the_batch_and_weigh_to_its_mean(n, world):
    losses = torch.arange(n, dtype=torch.float64) ** 2  # a loss per item
    parts = [local_part(n, SimpleNamespace(num_processes=world, process_index=r)) for r in range(world)]
    real = [p for p, w in parts if w > 0]
    assert [i for p in real for i in range(n)[p]] == list(range(n))  # contiguous, in order, each item once
    # DDP averages the processes' weighted local means: that must be the global mean
    ddp = sum(w * float(losses[p].mean()) for p, w in parts) / world
    assert ddp == pytest.approx(float(losses.mean()))
    assert all(p == slice(0, 1) for p, w in parts if w == 0)  # an idle process still has an item to run
