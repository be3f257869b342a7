"""DrafterSpec: the one grammar that names a drafter (generate, specdec eval / serve / generate, the
recipes): parsing, round trip, the defaults stored once, and errors that say what is wrong."""

import argparse

import pytest
import torch

import specdec
from specdec.drafters import EagleDrafter, HybridDrafter, MedusaDrafter, ModelDrafter
from specdec.drafters.eagle.drafter import EagleTreeConfig
from specdec.drafters.medusa.heads import DEFAULT_TREE_NODES
from specdec.loader import DrafterLoader, make_drafter
from specdec.methods import DRAFTERS, GRAMMAR, DrafterSpec
from specdec.sampling import SamplingParams

GOOD = {
    "ngram": DrafterSpec("ngram"),
    "ngram@3": DrafterSpec("ngram", size=3),
    "draft:some/dir@auto": DrafterSpec("draft", "some/dir", "auto"),
    "draft:/u@corp/ckpt": DrafterSpec("draft", "/u@corp/ckpt"),  # an "@" inside a path is part of it
    "draft:/u@corp:1x2": DrafterSpec("draft", "/u@corp:1x2"),
    "hybrid:m@4": DrafterSpec("hybrid", "m", 4),
    "ngram+draft:m": DrafterSpec("hybrid", members=(DrafterSpec("ngram"), DrafterSpec("draft", "m"))),
    "ngram+draft:m@4": DrafterSpec("hybrid", size=4, members=(DrafterSpec("ngram"), DrafterSpec("draft", "m"))),
    "medusa:heads@20": DrafterSpec("medusa", "heads", 20),
    "eagle:e": DrafterSpec("eagle", "e"),
    "eagle:e@96:8x10": DrafterSpec("eagle", "e", 96, (8, 10)),
    "eagle:e@auto:3x4": DrafterSpec("eagle", "e", "auto", (3, 4)),
    "suffix": DrafterSpec("suffix"),
    "suffix@12": DrafterSpec("suffix", size=12),
    "draft:m@auto:p0.6": DrafterSpec("draft", "m", "auto", p_min=0.6),
    "hybrid:m@4:p0.3": DrafterSpec("hybrid", "m", 4, p_min=0.3),
    "ngram+draft:m@auto:p0.5": DrafterSpec("hybrid", size="auto", p_min=0.5,
                                           members=(DrafterSpec("ngram"), DrafterSpec("draft", "m"))),
    "suffix|draft:m@auto": DrafterSpec("composite", members=(DrafterSpec("suffix"), DrafterSpec("draft", "m", "auto"))),
    "ngram|suffix@5|draft:m@4:p0.6": DrafterSpec("composite", members=(
        DrafterSpec("ngram"), DrafterSpec("suffix", size=5), DrafterSpec("draft", "m", 4, p_min=0.6))),
}


@pytest.mark.parametrize("text", list(GOOD))
def test_parse_and_round_trip(text):
    spec = DrafterSpec.parse(f"  {text} ")
    assert spec == GOOD[text]
    assert str(spec) == text and DrafterSpec.parse(str(spec)) == spec


def test_draft_length_and_parts():
    assert DrafterSpec.parse("draft:x@7").draft_length == 7
    assert DrafterSpec.parse("eagle:e@7").draft_length is None  # a tree's nodes, not a draft length
    assert DrafterSpec.parse("ngram+draft:x@auto").draft_length == "auto"
    assert DrafterSpec.parse("hybrid:x").parts == (DrafterSpec("ngram"), DrafterSpec("draft", "x"))
    assert DrafterSpec.parse("draft:x+ngram").parts == (DrafterSpec("draft", "x"), DrafterSpec("ngram"))
    assert DrafterSpec.parse("qwen@3", bare="draft") == DrafterSpec("draft", "qwen", 3)  # --draft NAME
    assert DrafterSpec.parse("ngram+qwen", bare="draft").parts[1] == DrafterSpec("draft", "qwen")
    # a list's @K:pP is its draft models'
    assert DrafterSpec.parse("hybrid:x@4:p0.5").parts[1] == DrafterSpec("draft", "x", 4, p_min=0.5)
    assert DrafterSpec.parse("suffix|draft:x@auto").draft_length == "auto"
    assert DrafterSpec.parse("suffix|ngram").draft_length is None


def test_defaults_live_once():
    """The EAGLE tree's defaults are EagleTreeConfig's, the Medusa tree's specdec.drafters.medusa.heads's."""
    assert DrafterSpec.parse("eagle:e").eagle_tree == EagleTreeConfig()
    assert DrafterSpec.parse("eagle:e@16").eagle_tree == EagleTreeConfig(total_tokens=16)
    assert DrafterSpec("eagle", "e", shape=(3, 6)).size == EagleTreeConfig.total_tokens
    assert DrafterSpec.parse("eagle:e@auto").eagle_tree is None  # timed first
    from distill import MedusaTrainConfig

    assert MedusaTrainConfig.tree_nodes == DEFAULT_TREE_NODES
    assert set(DRAFTERS) >= {"ngram", "draft", "hybrid", "medusa", "eagle"}


@pytest.mark.parametrize("text, msg", [
    ("", "empty drafter spec"),
    ("ngram+", "empty drafter after its last '\\+'"),
    ("+ngram", "empty drafter before its first '\\+'"),
    ("beam", "unknown drafter 'beam'; a drafter spec is ngram"),
    ("draft", "needs a model: write draft:NAME_OR_PATH"),
    ("eagle", "needs a directory: write eagle:DIR"),
    ("ngram:x", "takes no argument"),
    ("ngram@3:2x2", "only eagle takes a tree shape"),
    ("ngram@0", "an integer in \\[1, 64\\]"),
    ("draft:x@65", "an integer in \\[1, 64\\]"),
    ("medusa:h@auto", "integer >= 1"),
    ("eagle:e@0", "total_tokens must be"),
    ("eagle:e@40:2x4", "exceeds the 20 candidates"),
    ("eagle:e@auto:1x1", "this shape holds 1"),
    ("eagle:e+ngram", "members draft chains"),
    ("ngram@3+draft:x", "share one draft length: write it once after the last member"),
    ("suffix@0", "the tree's nodes N must be an integer >= 1"),
    ("suffix:x", "takes no argument"),
    ("ngram+suffix", "members draft chains"),
    ("draft:x@auto:p1.5", "a probability in \\[0, 1\\)"),
    ("eagle:e@6:p0.5", "DEPTHxTOP_K"),
    ("suffix|", "empty drafter beside a '\\|'"),
    ("suffix|medusa:h", "read no target states"),
    ("suffix|ngram+draft:x", "a hybrid \\(A\\+B\\) cannot be one"),
    ("ngram@3|draft:x@4", "share one draft length K"),
])
def test_errors_say_what_is_wrong(text, msg):
    with pytest.raises(ValueError, match=msg):
        DrafterSpec.parse(text)


GRAMMAR_TAIL = f"; a drafter spec is {GRAMMAR}"


@pytest.mark.parametrize("text, first", [
    ("ngram+", "'ngram+' has an empty drafter after its last '+': a hybrid joins two or more drafters with '+', "
               "e.g. ngram+draft:NAME_OR_PATH"),
    ("+ngram", "'+ngram' has an empty drafter before its first '+'"),
    ("ngram++draft:x", "'ngram++draft:x' has an empty drafter between two '+'"),
    ("draft:", "drafter 'draft' needs a model: write draft:NAME_OR_PATH"),
    ("ngram@", "'ngram@' ends in '@' with nothing after it: write the draft length K (1-64 or auto) there, or drop "
               "the '@'"),
    ("ngram@x", "'ngram@x': after ngram's '@' comes the draft length K (1-64 or auto), got 'x'"),
    ("eagle:@3", "'eagle:@3': drafter 'eagle' needs a directory: write eagle:DIR"),
    ("eagle:e@6:3x", "'eagle:e@6:3x': the tree shape after ':' is DEPTHxTOP_K (e.g. @6:3x2), got '3x'"),
    ("draft:m@", "'draft:m@' ends in '@' with nothing after it"),
    ("", "an empty drafter spec"),
    ("ngram@@3", "'ngram@@3' has a second '@': a spec takes one '@' suffix, e.g. ngram@4"),
    ("ngram@3@4", "'ngram@3@4' has a second '@'"),
    ("NGRAM", "unknown drafter kind 'NGRAM': kinds are lowercase, write 'ngram' (a path spelt so: './NGRAM')"),
    ("Draft:m@4", "unknown drafter kind 'Draft': kinds are lowercase, write 'draft:m@4'"),
    ("medusa:heads@x", "'medusa:heads@x': after medusa's '@' comes the tree's nodes N (an integer >= 1), got 'x' "
                       "(a directory whose name holds an '@' ends in '/': medusa:heads@x/)"),
    ("medusa:heads@-1", "'medusa:heads@-1': after medusa's '@' comes the tree's nodes N (an integer >= 1), got '-1'"),
    ("medusa:heads@4@5", "'medusa:heads@4@5' has a second '@': write medusa:DIR@N with one '@' (a directory whose "
                         "name holds an '@' ends in '/')"),
    ("eagle:head@x", "'eagle:head@x': after eagle's '@' comes the tree's nodes N (or auto)"),
    # digits other than ASCII ones ("²" passed str.isdigit, then int() raised "invalid literal")
    ("suffix@²", "'suffix@²': after suffix's '@' comes the tree's nodes N (an integer >= 1), got '²'"),
    ("ngram@٣", "'ngram@٣': after ngram's '@' comes the draft length K (1-64 or auto), got '٣'"),
])
def test_malformed_specs_say_what_is_wrong_then_show_the_grammar(text, first):
    """With bare="draft" (the command lines' --draft), a malformed spec is not taken for a model path
    (`ngram@` used to become the draft model 'ngram@', `ngram+` a path that "has no config.json")."""
    with pytest.raises(ValueError) as err:
        DrafterSpec.parse(text, bare="draft")
    message = str(err.value)
    assert message.splitlines()[0].startswith(first) and message.endswith(GRAMMAR_TAIL), message


def test_an_at_inside_a_path_stays_part_of_the_path():
    assert DrafterSpec.parse("draft:/u@corp/ckpt") == DrafterSpec("draft", "/u@corp/ckpt")
    assert DrafterSpec.parse("m@x", bare="draft") == DrafterSpec("draft", "m@x")
    assert DrafterSpec.parse("eagle:e@6:3x2") == DrafterSpec("eagle", "e", 6, (3, 2))


@pytest.mark.parametrize("path, spec", [("./ngram@/", "{}@3"), ("./ngram@3/", "{}@4"), ("./NGRAM", "{}"),
                                        ("heads@x/", "medusa:{}"), ("heads@-1/", "medusa:{}"),
                                        ("heads@4/", "medusa:{}@5"), ("head@x/", "eagle:{}")])
def test_paths_that_look_like_misspelled_specs_are_written_with_a_slash(tmp_path, monkeypatch, path, spec):
    """Parsing never looks at the filesystem: a directory named like a misspelled spec changes nothing
    (the malformed-spec errors still say what is wrong), and that path written with a trailing '/'
    (or, spelt like a kind, a leading './') is a path."""
    monkeypatch.chdir(tmp_path)
    misspelled = path.removeprefix("./").removesuffix("/")
    (tmp_path / misspelled).mkdir()
    with pytest.raises(ValueError):
        DrafterSpec.parse(spec.format(misspelled), bare="draft")
    parsed = DrafterSpec.parse(spec.format(path), bare="draft")
    assert parsed.arg == path and parsed.kind == ("draft" if spec.startswith("{}") else spec.partition(":")[0])


def test_generate_takes_spec_strings(target):
    """generate(draft=...) reads the grammar; a spec's @K is its draft length (greedy output = plain)."""
    ids = torch.randint(0, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0)).repeat(1, 3)
    plain = specdec.generate(target, ids, max_new_tokens=10).sequences
    out = specdec.generate(target, ids, draft="ngram@2", max_new_tokens=10)
    assert torch.equal(out.sequences, plain)
    assert 0 < max(len(out.stats.per_position_acceptance), 1) <= 2  # drafts of at most 2 tokens per step


def test_loader_caches_and_builds_every_kind(target, random_draft):
    loader = DrafterLoader()
    loader.model = lambda name, tgt: random_draft  # a loader decides how a name becomes a model
    assert isinstance(make_drafter("draft:any@3", target, loader=loader), ModelDrafter)
    hybrid = make_drafter("ngram+draft:any", target, loader=loader)
    assert isinstance(hybrid, HybridDrafter) and len(hybrid.drafters) == 2
    assert isinstance(make_drafter(DrafterSpec("hybrid", "any"), target, loader=loader), HybridDrafter)
    assert loader.cached(("k",), lambda: 1) == 1 and loader.cached(("k",), lambda: 2) == 1


def test_eagle_and_medusa_specs_load_their_trees(target, tmp_path):
    from distill import attach_medusa, save_medusa

    torch.manual_seed(0)
    cfg = specdec.Eagle3Config.from_target(target, aux_layers=(0, 1, 1))
    specdec.save_eagle(specdec.Eagle3Head(cfg), tmp_path / "eagle")
    drafter = make_drafter(f"eagle:{tmp_path / 'eagle'}@6:3x2", target)
    assert isinstance(drafter, EagleDrafter) and drafter.tree == EagleTreeConfig(3, 2, 6)
    assert make_drafter(f"eagle:{tmp_path / 'eagle'}", target).tree == EagleTreeConfig()
    with pytest.raises(ValueError, match="none were given"):
        make_drafter(f"eagle:{tmp_path / 'eagle'}@auto", target)  # no prompts to time the sizes on
    save_medusa(attach_medusa(target, num_heads=2), tmp_path / "medusa")
    assert isinstance(make_drafter(f"medusa:{tmp_path / 'medusa'}", target), MedusaDrafter)
    small = make_drafter(f"medusa:{tmp_path / 'medusa'}@5", target)
    assert small.max_nodes(0) == 5


def test_unknown_strings_name_the_grammar(target):
    with pytest.raises(ValueError, match="has an empty drafter"):
        specdec.generate(target, torch.tensor([[1, 2, 3]]), draft="ngram+", max_new_tokens=2)
    with pytest.raises(ValueError, match="unknown drafter 'beam'"):
        specdec.generate(target, torch.tensor([[1, 2, 3]]), draft="beam", max_new_tokens=2)


def test_serve_aliases_build_specs():
    from specdec.serving.command import add_drafter_args, drafter_spec, own_draft_length

    p = argparse.ArgumentParser()
    add_drafter_args(p)
    assert drafter_spec(p.parse_args(["--draft", "ngram+qwen@3"])) == DrafterSpec.parse("ngram+draft:qwen@3")
    assert drafter_spec(p.parse_args(["--eagle", "e"])) == DrafterSpec("eagle", "e")
    assert drafter_spec(p.parse_args(["--eagle", "e", "--eagle-tree", "auto", "--eagle-depth", "3"])) == \
        DrafterSpec("eagle", "e", "auto", (3, EagleTreeConfig.top_k))
    assert drafter_spec(p.parse_args(["--medusa", "m"])) == DrafterSpec("medusa", "m")
    assert drafter_spec(p.parse_args([])) is None
    assert own_draft_length(DrafterSpec.parse("ngram@3"), 5) == 3 and own_draft_length(None, 5) == 5


def test_one_sampling_params():
    """generate's keywords, the engine's requests and eval's config check sampling in one place."""
    from specdec.evaluation.evaluate import EvalConfig
    from specdec.serving.engine import SamplingParams as EngineParams

    assert EngineParams is SamplingParams is specdec.SamplingParams
    assert SamplingParams().generator() is None
    a, b = SamplingParams(temperature=1.0, seed=3).generator(), SamplingParams(temperature=1.0, seed=3).generator()
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))
    cfg = EvalConfig(out="x", dataset="sharegpt", temperature=0.5, top_k=4)
    assert cfg.sampling == SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.5, top_k=4)
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
        with pytest.raises(ValueError):
            EvalConfig(out="x", dataset="sharegpt", **bad)


def test_eval_methods_are_specs():
    """specdec eval's drafting methods are drafter specs; its other methods stay its own."""
    from specdec.methods import Method, parse_methods

    hybrid, medusa, eagle = parse_methods("ngram+draft:m@3,medusa:h@12,eagle:e@auto:3x4")
    assert (hybrid.kind, hybrid.draft_length, hybrid.drafter) == ("hybrid", 3, DrafterSpec.parse("ngram+draft:m@3"))
    assert (medusa.spec.size, medusa.draft_length) == (12, None)  # a tree's nodes, not a draft length
    assert eagle.drafter == DrafterSpec("eagle", "e", "auto", (3, 4)) and eagle.drafter.tree_fields == {"depth": 3,
                                                                                                        "top_k": 4}
    assert Method.parse("hf").drafter is None
    for bad, msg in [("ngram+", "empty drafter"), ("ngram+hf", "unknown drafter 'hf'"), ("hf@3", "draft length")]:
        with pytest.raises(ValueError, match=msg):
            parse_methods(bad)


def test_a_bad_draft_on_the_command_line_fails_first_and_says_why(tmp_path, capsys, monkeypatch):
    """`--draft ngram+` names what is wrong, before any model loads (the model here does not exist)."""
    from specdec.cli import main as cli_main

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    for argv in (["generate", "--prompt", "a"], ["serve", "--port", "0"]):
        for draft, what in [("ngram+", "'ngram+' has an empty drafter after its last '+'"),
                            ("ngram@", "'ngram@' ends in '@' with nothing after it"),
                            ("eagle:@3", "'eagle:@3': drafter 'eagle' needs a directory")]:
            assert cli_main([*argv, "--model", str(tmp_path / "missing"), "--draft", draft]) == 2
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and err[0].startswith(f"specdec {argv[0]}: error: {what}"), err
            assert err[0].endswith(GRAMMAR) and "missing" not in err[0], err


@pytest.mark.parametrize("p", [0.999999999999, 1e-7, 0.0, 0.5, 1e-300, 0.1, 0.9999999999999999])
def test_a_probability_round_trips_through_str(p):
    spec = DrafterSpec("draft", "m", 4, p_min=p)
    assert "e" not in str(spec).rpartition(":p")[2]
    assert DrafterSpec.parse(str(spec)) == spec and DrafterSpec.parse(str(spec)).p_min == p


@pytest.mark.parametrize("text", ["x" * 10_000, "draft:" + "x" * 10_000, "medusa:" + "d/" * 3_000 + "@4",
                                  "ngram|draft:" + "y" * 300])
def test_specs_longer_than_a_path_say_so_in_a_short_line(text):
    with pytest.raises(ValueError, match="characters long") as err:
        DrafterSpec.parse(text, bare="draft")
    assert len(str(err.value)) < 1_000 and "\n" not in str(err.value)


def test_members_must_be_a_tuple():
    with pytest.raises(TypeError, match=r"DrafterSpec.members is a tuple of DrafterSpec .* got None"):
        DrafterSpec("composite", members=None)
