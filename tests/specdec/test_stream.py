"""Streaming: generate(streamer=...) with transformers' own streamers, and the specdec.stream iterator."""

import threading

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TextIteratorStreamer, TextStreamer

import specdec
from tests.specdec.conftest import V


@pytest.fixture(scope="module")
def tok():
    """A word-level tokenizer over the tiny vocabulary: token i is the word 'w{i}'."""
    vocab = {f"w{i}": i for i in range(V)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0")


class Recorder:
    """A streamer that records what it was given (the protocol's put / end)."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended += 1


def _prompt(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, V, (n // 2,), generator=g)
    return torch.cat([base, base])[None]  # (1, n): repeats, so n-gram lookup finds drafts


@pytest.mark.parametrize("which", [None, "ngram", "draft"])
def test_streamed_ids_equal_the_sequences(target, random_draft, which):
    draft = random_draft if which == "draft" else which
    ids = _prompt()
    rec = Recorder()
    out = specdec.generate(target, ids, draft=draft, max_new_tokens=20, streamer=rec)
    assert torch.equal(rec.puts[0], ids) and rec.ended == 1
    streamed = torch.cat(rec.puts[1:])
    assert torch.equal(streamed, out.sequences[0, ids.shape[1]:])
    assert len(rec.puts) - 1 == out.stats.target_forwards  # one put per step that emitted
    if which == "ngram":
        assert any(p.numel() > 1 for p in rec.puts[1:])  # steps that accepted drafts stream them together


def test_text_streamer_prints_the_completion(target, tok, capsys):
    ids = _prompt(seed=1)
    out = specdec.generate(target, ids, draft="ngram", max_new_tokens=16, streamer=TextStreamer(tok, skip_prompt=True))
    printed = capsys.readouterr().out
    assert printed.split() == tok.decode(out.sequences[0, ids.shape[1]:]).split()


def test_text_iterator_streamer_from_another_thread(target, random_draft, tok):
    ids = _prompt(seed=2)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=specdec.generate(
        target, ids, draft=random_draft, max_new_tokens=16, streamer=streamer)))
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text.split() == tok.decode(result["out"].sequences[0, ids.shape[1]:]).split()


def test_a_streamer_with_several_rows_is_refused(target):
    ids = torch.cat([_prompt(seed=3), _prompt(seed=4)])
    with pytest.raises(ValueError, match="streamer follows one row"):
        specdec.generate(target, ids, max_new_tokens=4, streamer=Recorder())


@pytest.mark.parametrize("which", [None, "ngram", "draft"])
def test_stream_iterator_yields_each_steps_tokens(target, random_draft, which):
    draft = random_draft if which == "draft" else which
    ids = _prompt(seed=5)
    out = specdec.generate(target, ids, draft=draft, max_new_tokens=18)
    chunks = list(specdec.stream(target, ids, draft=draft, max_new_tokens=18))
    assert all(chunks)
    assert sum(chunks, []) == out.sequences[0, ids.shape[1]:].tolist()
    assert len(chunks) == out.stats.target_forwards


def test_stream_stops_at_eos_and_checks_arguments_at_the_call(target):
    ids = _prompt(seed=6)
    free = specdec.generate(target, ids, max_new_tokens=10).sequences[0, ids.shape[1]:].tolist()
    eos = free[3]
    got = sum(specdec.stream(target, ids, max_new_tokens=10, eos_token_id=eos), [])
    assert got == free[:free.index(eos) + 1]
    with pytest.raises(ValueError, match="one prompt"):
        specdec.stream(target, [ids[0], ids[0]])
    with pytest.raises(ValueError, match="temperature"):
        specdec.stream(target, ids, temperature=-1.0)
