"""distill.recover: the 2:4 mask survives training and the compressed round trip, KD lowers the gap, resume."""

import argparse
import copy
import importlib
import json

import pytest
import torch

import distill
import quant
import runtime
from distill.command import add_recover_parser, cmd_recover
from distill.config_args import dataclass_from_args
from distill.recover.train import MaskedSparse24, RecoverConfig, kd_loss, window_perplexity
from runtime.qlinear import Int8Linear, Sparse24Linear, unpack_24_indices
from runtime.tiny import tiny_model

CFG = dict(steps=40, batch_size=8, micro_batch=4, lr=1e-2, warmup_steps=2, eval_every=10, checkpoint_every=10,
           mixed_precision="no")


def _windows(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (n, 24), generator=torch.Generator().manual_seed(seed))  # (N, T)


@pytest.fixture(scope="module")
def teacher():
    """A tiny random Llama with weights 8x the initialiser's: peaked distributions, a visible pruning gap."""
    model = tiny_model("llama", seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


def _student(teacher):
    return quant.sparsify_(copy.deepcopy(teacher), quant.SemiStructured24(method="magnitude"), progress=False)


def _sparse(model) -> dict[str, Sparse24Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Sparse24Linear)}


def _assert_24(model, masks: dict[str, torch.Tensor]) -> None:
    """Every group of four inputs of every sparse linear: at most two nonzeros, none outside `masks`."""
    assert set(_sparse(model)) == set(masks)
    for name, mod in _sparse(model).items():
        w = mod.dequantize()  # (N, K)
        groups = (w != 0).view(w.shape[0], -1, 4)
        assert int(groups.sum(-1).max()) <= 2, name
        assert not (groups & ~masks[name].view_as(groups)).any(), name


def _masks(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, mod in _sparse(model).items():
        keep = torch.zeros(mod.out_features, mod.in_features // 4, 4, dtype=torch.bool)
        keep.scatter_(-1, unpack_24_indices(mod.indices), True)
        out[name] = keep.view(mod.out_features, mod.in_features)
    return out


def _kl(student, teacher, windows) -> float:
    pos = torch.arange(windows.shape[1]).expand_as(windows)
    with torch.no_grad():
        return float(kd_loss(student(windows, pos, None).logits, teacher(windows, pos, None).logits, windows))


def test_kd_loss_matches_hand_computed_value():
    s = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]]])  # (1, 2, 3)
    t = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    tokens = torch.tensor([[0, 2]])
    p, q = t.softmax(-1), s.softmax(-1)
    kl = (p * (p.log() - q.log())).sum(-1).mean()
    assert torch.allclose(kd_loss(s, t, tokens), kl)
    ce = -q[0, 0, 2].log()
    assert torch.allclose(kd_loss(s, t, tokens, ce_weight=0.5), kl + 0.5 * ce)
    p2, q2 = (t / 2).softmax(-1), (s / 2).softmax(-1)
    assert torch.allclose(kd_loss(s, t, tokens, temperature=2.0), 4 * (p2 * (p2.log() - q2.log())).sum(-1).mean())


def test_masked_module_computes_the_sparse_linear():
    mod = Sparse24Linear.from_dense(_pruned(torch.randn(8, 16, generator=torch.Generator().manual_seed(0))))
    masked = MaskedSparse24(mod)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(masked(x), mod(x))
    back = masked.to_sparse(torch.float32)
    assert torch.equal(back.indices, mod.indices) and torch.equal(back.values, mod.values)


def _pruned(w: torch.Tensor) -> torch.Tensor:
    from quant.grids import mask_24

    return w.masked_fill(mask_24(w.abs()), 0.0)


def test_recover_keeps_the_mask_closes_the_gap_and_round_trips(teacher, tmp_path):
    student = _student(teacher)
    masks = _masks(student)
    before = {n: m.values.clone() for n, m in _sparse(student).items()}
    train, held = _windows(128, 0), _windows(4, 1)
    kl0 = _kl(student, teacher, held)
    metrics = distill.recover(student, teacher, train, RecoverConfig(**CFG), tmp_path / "run", heldout=held)
    assert metrics["steps"] == 40 and len(metrics["losses"]) == 40
    assert [e["step"] for e in metrics["evals"]] == [0, 10, 20, 30, 40]
    assert metrics["evals"][-1]["perplexity"] == pytest.approx(window_perplexity(student, held))
    _assert_24(student, masks)
    assert any(not torch.equal(before[n], m.values) for n, m in _sparse(student).items())
    assert _kl(student, teacher, held) < 0.7 * kl0
    assert (tmp_path / "run" / "recovery.png").is_file()
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 40
    out = quant.save_compressed(student, tmp_path / "ckpt")
    back = runtime.load_model(out, dtype=torch.float32)
    _assert_24(back, masks)
    ids = held[:2]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        assert torch.equal(back(ids, pos, None).logits, student(ids, pos, None).logits)


class _Interrupted(torch.nn.Module):
    """The teacher, stopped like Ctrl-C at its `calls`-th forward."""

    def __init__(self, model, calls: int) -> None:
        super().__init__()
        self.model, self.calls, self.config = model, calls, model.config

    def forward(self, *args):
        self.calls -= 1
        if self.calls < 0:
            raise KeyboardInterrupt
        return self.model(*args)


def test_resume_after_interruption_gives_the_uninterrupted_result(teacher, tmp_path):
    train, cfg = _windows(16, 0), RecoverConfig(**{**CFG, "steps": 6})
    straight = _student(teacher)
    distill.recover(straight, teacher, train, cfg, tmp_path / "a")
    resumed = _student(teacher)
    with pytest.raises(KeyboardInterrupt):  # 2 forwards per step: stopped during step 4
        distill.recover(resumed, _Interrupted(teacher, 7), train, cfg, tmp_path / "b")
    trainer = json.loads((tmp_path / "b" / "checkpoint" / "recover_trainer.json").read_text())
    assert trainer["step"] == 3
    resumed = _student(teacher)
    metrics = distill.recover(resumed, teacher, train, cfg, tmp_path / "b")
    assert metrics["steps"] == 6 and len(metrics["losses"]) == 6
    for (name, a), b in zip(_sparse(straight).items(), _sparse(resumed).values()):
        assert torch.allclose(a.values, b.values, atol=1e-6), name


def test_recover_refuses_bad_input(teacher):
    with pytest.raises(ValueError, match="no 2:4-sparse linears"):
        distill.recover(copy.deepcopy(teacher), teacher, _windows(4, 0), RecoverConfig(**CFG))
    int4 = quant.sparsify_(copy.deepcopy(teacher), quant.SemiStructured24(method="sparsegpt", int4_group_size=32),
                           calibration=_windows(4, 0), progress=False)
    with pytest.raises(ValueError, match="Sparse24Int4Linear"):
        distill.recover(int4, teacher, _windows(4, 0), RecoverConfig(**CFG))
    with pytest.raises(ValueError, match="LongTensor"):
        distill.recover(_student(teacher), teacher, torch.zeros(4, 8), RecoverConfig(**CFG))
    with pytest.raises(ValueError, match="RecoverConfig.micro_batch"):
        RecoverConfig(micro_batch=0)


def test_a_refused_or_failed_recovery_leaves_no_output_directory_and_the_student_as_it_was(teacher, tmp_path,
                                                                                          monkeypatch, snapshot):
    (tmp_path / "empty").mkdir()
    before = snapshot(tmp_path)
    cfg = RecoverConfig(**CFG)
    student = _student(teacher)
    mixed = _student(teacher)  # its last sparse linear an INT8 one: refused before any module is replaced
    last = list(_sparse(mixed))[-1]
    out_f, in_f = mixed.get_submodule(last).out_features, mixed.get_submodule(last).in_features
    mixed.set_submodule(last, Int8Linear(torch.zeros(out_f, in_f, dtype=torch.int8), torch.ones(out_f)))
    outside = _windows(4, 0)
    outside[2, 5] = 128
    for where in (tmp_path / "new" / "out", tmp_path / "empty"):
        for model, data, heldout, message in [
                (student, outside, None,
                 "data holds token id 128, outside the student's vocabulary [0, 128)"),
                (student, _windows(4, 0), _windows(2, 1) - 200, "heldout holds token id -"),
                (student, _windows(4, 0)[:0], None, "data must be a LongTensor (N, T) of token windows with N >= 1"),
                (mixed, _windows(4, 0), None, f"{last} is a Int8Linear")]:
            with pytest.raises(ValueError) as err:
                distill.recover(model, teacher, data, cfg, where, heldout=heldout)
            assert str(err.value).startswith(message)
        assert snapshot(tmp_path) == before
    assert not any(isinstance(m, MaskedSparse24) for m in [*student.modules(), *mixed.modules()])
    rc = importlib.import_module("distill.recover.train")

    def failing(*args, **kwargs):  # the first batch fails (out of memory, say)
        raise RuntimeError("first batch failed")

    monkeypatch.setattr(rc, "kd_loss", failing)
    for where in (tmp_path / "new" / "out", tmp_path / "empty"):
        with pytest.raises(RuntimeError, match="^first batch failed$"):
            distill.recover(_student(teacher), teacher, _windows(8, 0), cfg, where)
        assert snapshot(tmp_path) == before


def test_recover_command_flags_are_the_configs():
    sub = argparse.ArgumentParser(prog="specdec distill").add_subparsers()
    p = add_recover_parser(sub)
    args = p.parse_args(["--student", "s", "--teacher", "t", "--out", "o", "--lr", "2e-4", "--no-train-norms"])
    assert args.func is cmd_recover
    assert dataclass_from_args(RecoverConfig, args) == RecoverConfig(lr=2e-4, train_norms=False)
    with pytest.raises(SystemExit):
        p.parse_args(["--student", "s", "--teacher", "t", "--out", "o", "--micro-batch", "0"])


@pytest.mark.parametrize("seq_len, short", [(257, "teacher"), (200, "student")])
def test_recover_command_refuses_windows_longer_than_a_models_positions_before_loading(seq_len, short, tmp_path,
                                                                                       capsys, monkeypatch, snapshot):
    """Only the configs exist (no tokenizer, no weights): the check comes before anything loads."""
    from runtime.tiny import tiny_hf_config
    from specdec.cli import main

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    limits = {"teacher": 256, "student": 256 if short == "teacher" else 128}
    for name, limit in limits.items():
        tiny_hf_config(max_position_embeddings=limit).save_pretrained(tmp_path / name)
    before = snapshot(tmp_path)
    assert main(["distill", "recover", "--student", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"),
                 "--out", str(tmp_path / "out"), "--seq-len", str(seq_len)]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    limit = limits[short]
    assert first == (f"specdec distill recover: error: --seq-len {seq_len} is more than the {limit} positions "
                     f"of --{short} {tmp_path / short} (max_position_embeddings); pass --seq-len {limit} or less")
    assert snapshot(tmp_path) == before


def test_bf16_autocast_trains_and_keeps_the_mask(teacher):
    student = _student(teacher)
    masks = _masks(student)
    before = {n: m.values.clone() for n, m in _sparse(student).items()}
    metrics = distill.recover(student, teacher, _windows(16, 0), RecoverConfig(**{**CFG, "steps": 3,
                                                                                  "mixed_precision": "bf16"}))
    assert metrics["steps"] == 3 and all(torch.isfinite(torch.tensor(metrics["losses"])))
    assert student.dtype == torch.float32
    _assert_24(student, masks)
    assert any(not torch.equal(before[n], m.values) for n, m in _sparse(student).items())
