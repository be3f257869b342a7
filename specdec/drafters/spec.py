"""One way to name a drafter: `DrafterSpec`, parsed from one string grammar, and the registry of kinds.

`generate(draft="...")`, `specdec eval --methods`, `specdec serve --draft`, `specdec generate` and
the recipes all read this grammar:

    ngram[@K]                   prompt lookup (n-gram), its own draft length K (1-64 or auto)
    suffix[@N]                  suffix decoding over the prompt, the output and earlier responses;
                                trees of up to N nodes
    draft:NAME_OR_PATH[@K]      a draft model (catalogue name, checkpoint dir, .gguf or hub id)
    draft:NAME_OR_PATH@K:pP     ... each row stops drafting below draft probability P (0 <= P < 1)
    hybrid:NAME_OR_PATH[@K]     = ngram+draft:NAME_OR_PATH
    medusa:DIR[@N]              Medusa heads, their candidate tree rebuilt with N nodes
    eagle:DIR[@N[:DxK]]         an EAGLE-3 head; its dynamic tree keeps N nodes, D levels, top-k K
    eagle:DIR@auto[:DxK]        ... N timed on this machine first (specdec.tuning.eagle_tree)
    A+B[+C...][@K[:pP]]         chain drafters (ngram, draft:X) tried in order per step; the @K
                                after the last member is the whole list's draft length
    A|B[|C...]                  drafters (ngram, suffix, draft:X, each with its own @) asked per
                                step, each row verifying the proposal it expects most of

The defaults live once: the EAGLE tree's on `EagleTreeConfig`, the Medusa tree's in
`specdec.drafters.medusa.heads.DEFAULT_TREE_NODES`, the draft length in generate()'s `num_draft_tokens`. An "@"
that does not start a valid suffix stays part of the path (`draft:/u@corp/ckpt`). `str(spec)`
writes the spec back in the grammar: `DrafterSpec.parse(str(spec)) == spec`.

`spec.load(target, loader)` gives generate()'s `draft=` argument (a model, "ngram", heads, a
drafter or a list; generate turns it into a `specdec.drafter.Drafter` with its sampling); the
`DrafterLoader` loads what the spec names, and callers that load once per run (`specdec eval`)
or report what they load (`specdec serve`) pass their own. A new drafter is one file (its
Drafter and a `from_spec(spec, target, loader)`) plus one entry in `DRAFTERS`.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from runtime.args import check_path_length, describe
from specdec.drafters.eagle.drafter import AUTO_TREE_SIZES, EagleTreeConfig
from specdec.options import parse_draft_length

# what the "@..." suffix of a kind means
DRAFT_LENGTH, TREE_NODES, EAGLE_TREE = "draft length", "tree nodes", "eagle tree"
_TREE_SHAPE = re.compile(r"[0-9]+x[0-9]+")  # eagle's @N:DEPTHxTOP_K
_P_MIN = re.compile(r"p(0(\.[0-9]*)?|\.[0-9]+)")  # a draft model's @K:pP


@dataclass(frozen=True)
class DrafterKind:
    """One registry entry: `arg` names what follows "kind:" (None: the kind takes no argument), `size`
    what "@..." sets (DRAFT_LENGTH, TREE_NODES or EAGLE_TREE; None: no suffix), `chain` whether it
    drafts chains (only those join a hybrid), `load` the "module:function" that builds it (called
    as function(spec, target, loader), returning generate()'s draft argument), `varying_blocks`
    whether its trees change size every step (a compiled warm-up then builds every verification
    block: specdec.tuning.warmup), `gated_members` whether its members may go unrun in a warm-up (a
    composite's gates: each member is then warmed up alone)."""

    arg: str | None
    size: str | None
    chain: bool
    load: str
    varying_blocks: bool = False
    gated_members: bool = False


DRAFTERS: dict[str, DrafterKind] = {
    "ngram": DrafterKind(None, DRAFT_LENGTH, True, "specdec.drafters.ngram:from_spec"),
    "suffix": DrafterKind(None, TREE_NODES, False, "specdec.drafters.suffix:from_spec", varying_blocks=True),
    "draft": DrafterKind("NAME_OR_PATH", DRAFT_LENGTH, True, "specdec.drafters.model:from_spec"),
    "hybrid": DrafterKind("NAME_OR_PATH", DRAFT_LENGTH, False, "specdec.drafters.hybrid:from_spec"),  # ngram+draft:X
    "best": DrafterKind(None, None, False, "specdec.drafters.composite:from_spec", gated_members=True),  # A|B
    "medusa": DrafterKind("DIR", TREE_NODES, False, "specdec.drafters.medusa.drafter:from_spec"),
    "eagle": DrafterKind("DIR", EAGLE_TREE, False, "specdec.drafters.eagle.drafter:from_spec"),
}

GRAMMAR = ("ngram[@K], suffix[@N], draft:NAME_OR_PATH[@K[:pP]], hybrid:NAME_OR_PATH[@K[:pP]], medusa:DIR[@N], "
           "eagle:DIR[@N[:DxK]] (or @auto[:DxK]), chain drafters joined by '+' tried in order "
           "(e.g. ngram+draft:NAME@4), or drafters joined by '|', the best chosen per step "
           "(e.g. suffix|draft:NAME@auto)")


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter named in the grammar above: `kind` (a key of DRAFTERS), `arg` (model name, path or
    directory; None for ngram and for an A+B hybrid), `size` (the "@" value: the draft length K, an
    int or "auto", for ngram / draft / hybrid; the tree's nodes for medusa and eagle, "auto" for
    eagle; None = the default), `shape` (eagle: the tree's (depth, top_k); None = EagleTreeConfig's),
    `members` (an A+B hybrid's chain drafters, in order; an A|B composite's drafters, kind "best")
    and `p_min` (draft models: the probability below which a row stops drafting; None = never).
    Checked on construction."""

    kind: str
    arg: str | None = None
    size: int | str | None = None
    shape: tuple[int, int] | None = None
    members: tuple[DrafterSpec, ...] = ()
    p_min: float | None = None

    def __post_init__(self) -> None:
        entry = DRAFTERS.get(self.kind)
        if entry is None:
            raise ValueError(f"unknown drafter kind {self.kind!r}; choose from {', '.join(DRAFTERS)}")
        if not isinstance(self.members, (tuple, list)):
            raise TypeError(f"DrafterSpec.members is a tuple of DrafterSpec (a hybrid's or a composite's drafters; "
                            f"() for none), got {describe(self.members)}")
        if self.kind == "best":
            object.__setattr__(self, "members", tuple(self.members))
            self._check_composite()
        elif self.members:
            object.__setattr__(self, "members", tuple(self.members))
            self._check_members()
        elif entry.arg is not None and not self.arg:
            raise ValueError(f"drafter {self.kind!r} needs {_a(entry.arg)}: write {self.kind}:{entry.arg}")
        elif entry.arg is None and self.arg:
            raise ValueError(f"drafter {self.kind!r} takes no argument, got {self.kind}:{self.arg}")
        if isinstance(self.arg, str):
            check_path_length(f"drafter {self.kind}'s {entry.arg}", self.arg)
        if self.shape is not None:
            if entry.size != EAGLE_TREE:
                raise ValueError(f"{self}: only eagle takes a tree shape (@N:DEPTHxTOP_K)")
            object.__setattr__(self, "shape", tuple(self.shape))
            if self.size is None:  # a shape alone keeps the default number of nodes
                object.__setattr__(self, "size", EagleTreeConfig.total_tokens)
        if self.size is not None:
            object.__setattr__(self, "size", _check_size(self, entry.size))
        if self.p_min is not None:
            self._check_p_min()

    def _check_p_min(self) -> None:
        p = self.p_min
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise ValueError(f"a draft model's p_min (:pP) is a probability in [0, 1), got {p!r}")
        if self.size is None:
            raise ValueError(f"{self}: write the draft length before the probability, @K:pP (e.g. @auto:p{p})")
        if self.kind not in ("draft", "hybrid") or (self.members and all(m.kind != "draft" for m in self.members)):
            raise ValueError(f"{DrafterSpec(self.kind, self.arg, members=self.members)}: only a draft model stops "
                             "drafting below a probability (:pP); write it after a draft:NAME@K")
        object.__setattr__(self, "p_min", float(p))

    def _check_composite(self) -> None:
        if self.arg or self.size is not None or self.p_min is not None:
            raise ValueError("a composite A|B takes no argument, size or p_min of its own: its members carry theirs")
        if len(self.members) < 2:
            raise ValueError(f"a composite joins two or more drafters with '|', got {len(self.members)}")
        allowed = [k for k, e in DRAFTERS.items() if e.chain or k == "suffix"]
        for m in self.members:
            if not isinstance(m, DrafterSpec) or m.kind not in allowed:
                raise ValueError(f"a composite's members are drafters that read no target states "
                                 f"({', '.join(allowed)}), got {m}")
        lengths = {m.draft_length for m in self.members} - {None}
        if len(lengths) > 1:
            raise ValueError(f"a composite's members share one draft length K, got {sorted(map(str, lengths))}")

    def _check_members(self) -> None:
        if self.kind != "hybrid" or self.arg:
            raise ValueError("members make a hybrid: DrafterSpec('hybrid', members=(...)), without an argument")
        if len(self.members) < 2:
            raise ValueError(f"a hybrid joins two or more drafters with '+', got {len(self.members)}")
        for m in self.members:
            if not isinstance(m, DrafterSpec) or not DRAFTERS[m.kind].chain:
                raise ValueError(f"a hybrid's members draft chains ({', '.join(chain_kinds())}), got {m}")
            if m.size is not None:
                raise ValueError(f"the drafters of a hybrid share one draft length: write it once after the last "
                                 f"member (e.g. ngram+draft:NAME@4), not on {m}")

    @classmethod
    def parse(cls, text: str, bare: str | None = None) -> DrafterSpec:
        """The spec `text` names (grammar in the module docstring). `bare`: the kind a word without a
        known kind prefix takes ("draft" on the command lines, where `--draft NAME` names a draft
        model); None = such a word is an error. A ValueError says what is wrong with `text`, then
        shows the grammar."""
        if not isinstance(text, str):
            raise TypeError(f"a drafter spec is a string, got {type(text).__name__}")
        name = text.strip()
        try:
            if not name:
                raise ValueError("an empty drafter spec")
            if "|" in name:
                return cls._parse_composite(name, bare)
            return cls._parse_hybrid(name, bare) if "+" in name else cls._parse_one(name, bare)
        except ValueError as e:
            raise ValueError(f"{e}; a drafter spec is {GRAMMAR}") from e

    @classmethod
    def _parse_composite(cls, name: str, bare: str | None) -> DrafterSpec:
        parts = [p.strip() for p in name.split("|")]
        if not all(parts):
            raise ValueError(f"{_quote(name)} has an empty drafter beside a '|': a composite joins two or more "
                             "drafters with '|', e.g. suffix|draft:NAME_OR_PATH@auto")
        if any("+" in p for p in parts):
            raise ValueError(f"{_quote(name)}: a composite's members are single drafters; a hybrid (A+B) cannot be one")
        try:
            return cls("best", members=tuple(cls._parse_one(p, bare) for p in parts))
        except ValueError as e:
            raise ValueError(e.args[0] if name in str(e) or _quote(name) in str(e) else f"{_quote(name)}: {e}") from e

    @classmethod
    def _parse_hybrid(cls, name: str, bare: str | None) -> DrafterSpec:
        parts = [p.strip() for p in name.split("+")]
        if not all(parts):
            where = ("before its first '+'" if not parts[0] else "after its last '+'" if not parts[-1]
                     else "between two '+'")
            raise ValueError(f"{_quote(name)} has an empty drafter {where}: a hybrid joins two or more drafters with "
                             "'+', e.g. ngram+draft:NAME_OR_PATH")
        members = [cls._parse_one(p, bare) for p in parts]
        size = members[-1].size if DRAFTERS[members[-1].kind].size == DRAFT_LENGTH else None
        p_min = members[-1].p_min
        if size is not None:
            members[-1] = cls(members[-1].kind, members[-1].arg)
        try:
            return cls("hybrid", None, size, None, tuple(members), p_min)
        except ValueError as e:
            raise ValueError(f"{_quote(name)}: {e}") from e

    @classmethod
    def _parse_one(cls, name: str, bare: str | None) -> DrafterSpec:
        base, at, size = name.rpartition("@")
        size, colon, shape = size.partition(":")
        if at:
            _check_suffix(name, base, size, colon, shape)
        p_min = bool(colon and _P_MIN.fullmatch(shape))
        if not at or not (_digits(size) or size == "auto") or (colon and not p_min
                                                                 and not _TREE_SHAPE.fullmatch(shape)):
            base, at, size, colon, p_min = name, "", "", "", False  # an "@" inside a path is part of the path
        kind, _, arg = base.partition(":")
        if kind not in DRAFTERS:
            _check_misspelled(name, base)
            if bare is None:
                raise ValueError(f"unknown drafter {_quote(name)}")
            kind, arg = bare, base
        entry = DRAFTERS[kind]
        if at and entry.size is None:
            raise ValueError(f"{_quote(name)}: {kind} takes no @ suffix")
        if entry.arg == "DIR" and arg:
            _check_dir_suffix(name, kind, arg, bool(at))
        value = (int(size) if _digits(size) else size) if at else None
        try:
            if p_min:
                return cls(kind, arg or None, value, p_min=float(shape[1:]))
            return cls(kind, arg or None, value, tuple(map(int, shape.split("x"))) if colon else None)
        except ValueError as e:
            raise ValueError(e.args[0] if name in str(e) or _quote(name) in str(e) else f"{_quote(name)}: {e}") from e

    def __str__(self) -> str:
        if self.kind == "best":
            return "|".join(map(str, self.members))
        if self.members:
            text = "+".join(map(str, self.members))
        else:
            text = self.kind if self.arg is None else f"{self.kind}:{self.arg}"
        if self.size is not None:
            text += f"@{self.size}"
            if self.shape is not None:
                text += ":{}x{}".format(*self.shape)
            if self.p_min is not None:
                text += f":p{_decimal(self.p_min)}"
        return text

    @property
    def draft_length(self) -> int | str | None:
        """The spec's own draft length (an int or "auto"; in place of num_draft_tokens), None when it
        has none or its "@" sizes a tree; a composite's: its members' (they share one)."""
        if self.kind == "best":
            return next((m.draft_length for m in self.members if m.draft_length is not None), None)
        return self.size if DRAFTERS[self.kind].size == DRAFT_LENGTH else None

    @property
    def sized_by_k(self) -> bool:
        """Whether the spec drafts chains of the step's draft length k (its own @K or the run's)."""
        return self.kind == "best" or DRAFTERS[self.kind].size == DRAFT_LENGTH

    @property
    def varying_blocks(self) -> bool:
        """Whether a drafter it runs changes its trees' size every step."""
        return any(DRAFTERS[k].varying_blocks for k in self.kinds)

    @property
    def gated_members(self) -> bool:
        """Whether its members may go unrun in a warm-up (a composite's gates)."""
        return DRAFTERS[self.kind].gated_members

    @property
    def parts(self) -> tuple[DrafterSpec, ...]:
        """The drafters tried in order: a hybrid's members (hybrid:X = ngram, draft:X), else the spec itself."""
        if self.kind == "hybrid" and not self.members:
            return DrafterSpec("ngram"), DrafterSpec("draft", self.arg, self.size, p_min=self.p_min)
        if self.kind == "hybrid" and self.p_min is not None:  # the list's @K:pP is its draft models'
            return tuple(DrafterSpec(m.kind, m.arg, self.size, p_min=self.p_min) if m.kind == "draft" else m
                         for m in self.members)
        return self.members or (self,)

    @property
    def kinds(self) -> frozenset[str]:
        """The kinds of drafter this spec runs: its own, or its members' (a hybrid's parts, a composite's)."""
        return frozenset(p.kind for p in (self.members if self.kind == "best" else self.parts))

    @property
    def eagle_tree(self):
        """eagle: the EagleTreeConfig of a fixed size (the defaults filled in); None for @auto."""
        if self.kind != "eagle" or self.size == "auto":
            return None
        nodes = {} if self.size is None else {"total_tokens": self.size}
        return EagleTreeConfig(**self.tree_fields, **nodes)

    @property
    def tree_fields(self) -> dict[str, int]:
        """EagleTreeConfig keywords of the tree shape (empty: EagleTreeConfig's default depth and top_k)."""
        return dict(zip(("depth", "top_k"), self.shape or ()))

    def load(self, target, loader):
        """generate()'s `draft=` argument for this spec: models and heads loaded by `loader` (a
        `specdec.loader.DrafterLoader`)."""
        module, _, function = DRAFTERS[self.kind].load.partition(":")
        return getattr(importlib.import_module(module), function)(self, target, loader)


def _quote(text: str) -> str:
    """How a message shows a spec or path: its repr, cut after 100 characters (a spec may be any length)."""
    return repr(text) if len(text) <= 120 else f"{text[:100]!r}... ({len(text)} characters)"


def _decimal(p: float) -> str:
    """`p` in [0, 1) as the plain decimal (no exponent) of its shortest repr, so `float()` reads it back
    exactly and the :pP grammar takes it: 0.999999999999 -> '0.999999999999' (not '1'), 1e-07 ->
    '0.0000001', 0.0 -> '0'."""
    text = format(Decimal(repr(float(p))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _a(what: str) -> str:
    return f"a {'model' if what == 'NAME_OR_PATH' else 'directory'}"


def chain_kinds() -> list[str]:
    return [k for k, e in DRAFTERS.items() if e.chain]


# what follows "@", by what the suffix sets
_SUFFIX = {DRAFT_LENGTH: "the draft length K (1-64 or auto)", TREE_NODES: "the tree's nodes N (an integer >= 1)",
           EAGLE_TREE: "the tree's nodes N (or auto), optionally with :DEPTHxTOP_K"}


def _digits(text: str) -> bool:
    """Whether `text` is a number written in ASCII digits (str.isdigit also accepts "²" and "٣", which
    int() then refuses or reads)."""
    return text.isascii() and text.isdigit()


def _check_suffix(name: str, base: str, size: str, colon: str, shape: str) -> None:
    """ValueError for an "@" suffix of `name` that cannot be part of a path and is not a valid suffix:
    a spec that ends in "@", an "@" after a kind that takes no argument (`ngram@x`), an eagle tree
    shape that is not DEPTHxTOP_K (`eagle:DIR@6:3x`), or a probability out of [0, 1) (`@auto:p1.5`)."""
    kind = base.partition(":")[0]
    entry = DRAFTERS.get(kind)
    valid = _digits(size) or size == "auto"
    if not size and not colon:
        raise ValueError(f"{_quote(name)} ends in '@' with nothing after it"
                         + (f": write {_SUFFIX[entry.size]} there, or drop the '@'" if entry and entry.size else ""))
    shaped = not colon or _TREE_SHAPE.fullmatch(shape)
    if entry is not None and entry.arg is None and ":" not in base and not (valid and shaped):
        raise ValueError(f"{_quote(name)}: after {kind}'s '@' comes {_SUFFIX[entry.size]}, got "
                         f"{name[len(base) + 1:]!r}")
    if entry is not None and entry.size == EAGLE_TREE and valid and not shaped:
        raise ValueError(f"{_quote(name)}: the tree shape after ':' is DEPTHxTOP_K (e.g. @6:3x2), got {shape!r}")
    if valid and re.fullmatch(r"p[0-9.]+", shape) and not _P_MIN.fullmatch(shape):
        raise ValueError(f"{_quote(name)}: a draft model's :pP is a probability in [0, 1) (e.g. @auto:p0.5), got "
                         f"{shape!r}")


def _exists(path: str) -> bool:
    """Whether `path` exists; a ValueError (not OSError "File name too long") when it is longer than a
    path can be (`runtime.args.check_path_length`)."""
    check_path_length("the drafter spec's model or directory", path)
    return Path(path).expanduser().exists()


def _check_misspelled(name: str, base: str) -> None:
    """ValueError for a word without a known kind that is a misspelled spec rather than a model path
    (one that does not exist): a known kind before a second '@' (`ngram@@3`, `ngram@3@4`) or a kind
    in other case (`NGRAM`, `Draft:x`)."""
    if _exists(base):
        return
    leading = re.split(r"[@:]", name, maxsplit=1)[0]
    if leading in DRAFTERS and name.count("@") > 1:
        raise ValueError(f"{_quote(name)} has a second '@': a spec takes one '@' suffix, e.g. {leading}@4")
    if leading != leading.lower() and leading.lower() in DRAFTERS:
        raise ValueError(f"unknown drafter kind {leading!r}: kinds are lowercase, write "
                         f"{leading.lower() + name[len(leading):]!r}")


def _check_dir_suffix(name: str, kind: str, arg: str, sized: bool) -> None:
    """ValueError for an "@" inside a medusa / eagle directory that does not exist: a second '@'
    (`medusa:DIR@4@5`) or a size that is no valid suffix (`medusa:DIR@x`, `medusa:DIR@-1`), which
    would otherwise be read as part of the directory's name."""
    if "@" not in arg or _exists(arg):
        return
    tail = arg.rpartition("@")[2]
    if sized or _digits(tail.partition(":")[0]) or tail.partition(":")[0] == "auto":
        raise ValueError(f"{_quote(name)} has a second '@' (and no directory {_quote(arg)} exists): write "
                         f"{kind}:DIR@N with one '@'")
    raise ValueError(f"{_quote(name)}: after {kind}'s '@' comes {_SUFFIX[DRAFTERS[kind].size]}, got {tail!r} (and no "
                     f"directory {_quote(arg)} exists)")


def _check_size(spec: DrafterSpec, size: str) -> int | str:
    """The spec's "@" value, checked for what its kind's suffix means."""
    value = spec.size
    if size == DRAFT_LENGTH:
        return parse_draft_length(value)
    if isinstance(value, bool) or not (isinstance(value, int) or value == "auto"):
        raise ValueError(f"{spec.kind}'s @N is an integer number of tree nodes{' or auto' * (size == EAGLE_TREE)}, "
                         f"got {value!r}")
    if size == TREE_NODES:
        if value == "auto" or value < 1:
            raise ValueError(f"{DrafterSpec(spec.kind, spec.arg)}@{value}: the tree's nodes N must be an integer >= 1")
        return value
    shaped = spec.tree_fields
    try:  # N may pass 64: a tree's nodes are not a draft length
        if value != "auto":
            EagleTreeConfig(total_tokens=value, **shaped)
        elif EagleTreeConfig(total_tokens=1, **shaped).candidates < min(AUTO_TREE_SIZES):
            raise ValueError(f"auto times trees of {min(AUTO_TREE_SIZES)} nodes or more, but this shape holds "
                             f"{EagleTreeConfig(total_tokens=1, **shaped).candidates}")
    except ValueError as e:
        raise ValueError(f"{str(spec)!r}: {e}") from e
    return value
