"""Observers of the decode loop: what they are shown matches what the loop emits, and the target's
states they ask for come from the decoding forwards (runtime target or transformers adapter)."""

import pytest
import torch

import specdec
from runtime.tiny import tiny_pair
from specdec.capture import DecodeObserver, StateCapture
from specdec.drafter import Drafter
from tests.specdec.conftest import V


def _rows(seed=0, lengths=(3, 10, 6)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 8, (n,), generator=g).repeat(2) for n in lengths]


class Recorder(DecodeObserver):
    """Keeps every call: on_start's batch size, per row the prompt and each ModelOutput it got."""

    def __init__(self) -> None:
        self.batch_size, self.prompts, self.outs = None, {}, {}

    def on_start(self, target, batch_size: int) -> None:
        self.batch_size = batch_size

    def on_prefill(self, row, prompt, out) -> None:
        self.prompts[row], self.outs[row] = prompt, [out]

    def on_step(self, row, out) -> None:
        self.outs[row].append(out)


@pytest.mark.parametrize("draft", [None, "ngram", "self"])
def test_an_observer_sees_the_logits_that_chose_every_emitted_token(target, draft):
    """Greedy: the argmax of the logits each row's observer calls carry, concatenated, is exactly the
    row's new tokens (a row stopped by eos included), and states no one asked for stay None."""
    rows = _rows(seed=1)
    free = specdec.generate(target, rows, max_new_tokens=12).sequences
    eos = int(free[1][rows[1].numel() + 3])  # row 1 stops after 4 new tokens (or earlier)
    rec = Recorder()
    out = specdec.generate(target, rows, draft=target if draft == "self" else draft, max_new_tokens=12,
                           eos_token_id=eos, num_draft_tokens=3, observer=rec)
    assert rec.batch_size == 3 and sorted(rec.outs) == [0, 1, 2]
    for b, (prompt, seq) in enumerate(zip(rows, out.sequences)):
        assert torch.equal(rec.prompts[b], prompt)
        first, *steps = rec.outs[b]
        assert first.logits.shape == (1, V) and first.hidden is None and first.aux is None
        assert all(s.logits.shape[0] >= 1 and s.hidden is None and s.aux is None for s in steps)
        chosen = torch.cat([o.logits.argmax(-1) for o in rec.outs[b]])
        assert torch.equal(chosen, seq[prompt.numel():])
    assert out.sequences[1].numel() < rows[1].numel() + 12  # the eos row was cut


def test_several_observers_share_the_forwards_and_each_gets_what_it_asked(target):
    rows = _rows(seed=2)
    hidden, aux = StateCapture(hidden=True), StateCapture(aux_layers=(1, 0))
    out = specdec.generate(target, rows, draft="ngram", max_new_tokens=8, observer=[hidden, aux, Recorder()])
    assert hidden.aux_states is None and aux.hidden_states is None
    for r, s, h, a in zip(rows, out.sequences, hidden.hidden_states, aux.aux_states):
        ref = target(s[None], torch.arange(s.numel())[None], None, return_hidden=True, aux_layers=(1, 0))
        torch.testing.assert_close(h, ref.hidden[0, r.numel() - 1:-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a, ref.aux[0, :-1], rtol=1e-4, atol=1e-4)


def test_a_transformers_target_records_the_same_states_as_the_runtime():
    """HFAdapter returns hidden and aux states too, so capture works on a transformers target."""
    model, hf = tiny_pair("llama", seed=3, vocab_size=V)
    rows = _rows(seed=3)
    caps = [StateCapture(hidden=True, aux_layers=(0, 1)) for _ in range(2)]
    outs = [specdec.generate(m, rows, max_new_tokens=6, observer=c) for m, c in zip((model, hf), caps)]
    assert all(torch.equal(a, b) for a, b in zip(outs[0].sequences, outs[1].sequences))
    for name in ("hidden_states", "aux_states"):
        for a, b in zip(getattr(caps[0], name), getattr(caps[1], name)):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


class _ReadsLayers(Drafter):
    """A drafter that reads target layers (as an EAGLE-3 head does); never asked to draft here."""

    name = "reads-layers"
    hidden_layers = (0, 1)

    def propose(self, seqs, k, rows):
        raise AssertionError("the loop refuses the observers before any step")


def test_observers_and_a_drafter_that_reads_layers_must_name_the_same_ones(target):
    with pytest.raises(ValueError, match=r"aux_layers.*reads-layers"):
        specdec.generate(target, _rows(), draft=_ReadsLayers(), max_new_tokens=4,
                         observer=StateCapture(aux_layers=(1,)))
