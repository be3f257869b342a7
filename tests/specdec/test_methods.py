"""specdec.methods: one registry and one pure parser for every method string (drafters and baselines)."""

import os
from pathlib import Path

import pytest

from specdec.methods import BASELINES, DRAFTERS, METHODS, BaselineSpec, DrafterSpec, Method, parse_method

TEXTS = ["plain", "hf", "hf-pld", "hf-assisted:m", "llamacpp", "llamacpp-spec:q@4", "llamacpp-eagle3:h.gguf@5",
         "ngram@3", "suffix@5", "draft:m@auto:p0.5", "hybrid:m@4", "ngram+draft:m@3", "suffix|draft:m@auto",
         "medusa:h@12", "eagle:e@auto:3x4", "draft:/u@corp/ckpt", "draft:./ckpt@3/"]


@pytest.mark.parametrize("text", TEXTS)
def test_every_method_parses_to_a_frozen_config_that_writes_itself_back(text):
    spec = parse_method(text)
    assert isinstance(spec, DrafterSpec if spec.kind in DRAFTERS else BaselineSpec)
    assert str(spec) == text and parse_method(str(spec)) == spec
    with pytest.raises(AttributeError):
        spec.kind = "plain"  # frozen


def test_parsing_never_looks_at_the_filesystem(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the parser touched the filesystem")

    for name in ("exists", "is_file", "is_dir", "stat"):
        monkeypatch.setattr(Path, name, refuse)
    monkeypatch.setattr(os.path, "exists", refuse)
    for text in TEXTS:
        parse_method(text)
    for bad in ("ngram@@3", "NGRAM", "medusa:heads@x", "medusa:heads@4@5"):
        with pytest.raises(ValueError):
            parse_method(bad, bare="draft")


def test_one_registry_names_each_kind_once():
    assert set(DRAFTERS) | {"plain", *BASELINES} == set(METHODS)
    assert set(BASELINES) == {"hf", "hf-assisted", "hf-pld", "llamacpp", "llamacpp-spec", "llamacpp-eagle3"}
    assert "composite" in DRAFTERS and "best" not in METHODS  # one name per combinator: hybrid (A+B), composite (A|B)
    assert parse_method("ngram|suffix").kind == "composite" and parse_method("ngram+draft:m").kind == "hybrid"


def test_baselines_are_configs_too():
    assert parse_method("llamacpp-spec:q@4") == BaselineSpec("llamacpp-spec", "q", 4)
    assert Method.parse("llamacpp-spec:q@4").label == "llamacpp-spec@4" and Method.parse("hf").label == "hf"
    assert Method.parse("plain").label is None and Method.parse("ngram").label is None
    for bad, msg in [("hf@3", "draft length"), ("llamacpp-spec:q@auto", "integer"), ("hf-assisted", "needs a model"),
                     ("hf:x", "takes no argument"), ("ngram+hf", "unknown drafter 'hf'")]:
        with pytest.raises(ValueError, match=msg):
            parse_method(bad)
    with pytest.raises(ValueError, match="unknown drafter 'hf'"):
        DrafterSpec.parse("hf")  # generate(draft=...) and --draft take drafters only
