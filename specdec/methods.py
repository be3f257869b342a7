"""The one method grammar: every decoding method (plain, the drafters, the transformers and llama.cpp
baselines) is a registered kind (`METHODS`), and one parser (`parse_method`) reads its string into
a frozen, validated config: a `DrafterSpec` for the drafters, a `BaselineSpec` for the others.
`generate(draft="...")`, `specdec eval --methods`, `specdec serve --draft`, `specdec generate`, the
report and the recipes all read it:

    plain                       this runtime's plain decoding (eval)
    ngram[@K]                   prompt lookup (n-gram), its own draft length K (1-64 or auto)
    suffix[@N]                  suffix decoding over the prompt, the output and earlier responses;
                                trees of up to N nodes
    draft:NAME_OR_PATH[@K]      a draft model (catalogue name, checkpoint dir, .gguf or hub id)
    draft:NAME_OR_PATH@K:pP     ... each row stops drafting below draft probability P (0 <= P < 1)
    medusa:DIR[@N]              Medusa heads, their candidate tree rebuilt with N nodes
    eagle:DIR[@N[:DxK]]         an EAGLE-3 head; its dynamic tree keeps N nodes, D levels, top-k K
    eagle:DIR@auto[:DxK]        ... N timed on this machine first (specdec.tuning.eagle_tree)
    A+B[+C...][@K[:pP]]         the hybrid: chain drafters (ngram, draft:X) tried in order per step;
                                the @K after the last member is the whole list's draft length
    hybrid:NAME_OR_PATH[@K]     an alias: ngram+draft:NAME_OR_PATH
    A|B[|C...]                  the composite: drafters (ngram, suffix, draft:X, each with its own @)
                                asked per step, each row verifying the proposal it expects most of
    hf, hf-pld                  transformers generate() and its prompt lookup (eval)
    hf-assisted:NAME_OR_PATH    transformers assisted generation (eval)
    llamacpp                    llama.cpp's plain decoding of the target's GGUF (eval)
    llamacpp-spec:NAME_OR_GGUF[@K]  llama.cpp's draft-model speculative decoding, K drafts (an integer)
    llamacpp-eagle3:HEAD_GGUF[@K]   llama.cpp's EAGLE-3 decoding, a chain of K drafts (an integer)

Parsing is pure: it never looks at the filesystem; paths are resolved when loading
(`specdec.loader`). An "@" that does not start a valid suffix stays part of the path
(`draft:/u@corp/ckpt`); a path whose last "@" is followed by what reads as a suffix is written with
a trailing "/" (`draft:./ckpt@3/`), a path spelt like a kind with a leading "./". `str(spec)` writes
a config back in the grammar: `parse_method(str(spec)) == spec`. The defaults live once: the EAGLE
tree's on `EagleTreeConfig`, the Medusa tree's in `specdec.drafters.medusa.heads.DEFAULT_TREE_NODES`,
the draft length in generate()'s `num_draft_tokens`.

`spec.load(target, loader)` gives generate()'s `draft=` argument (a model, "ngram", heads, a
drafter or a list; generate turns it into a `specdec.drafter.Drafter` with its sampling); the
`specdec.loader.DrafterLoader` loads what the spec names. A new drafter is one file (its Drafter
and a `from_spec(spec, target, loader)`) plus one entry in `METHODS`.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from decimal import Decimal

from runtime.args import check_path_length, describe
from specdec.drafters.eagle.drafter import AUTO_TREE_SIZES, EagleTreeConfig
from specdec.options import parse_draft_length

# what the "@..." suffix of a kind means (FIXED_DRAFTS: an integer draft length, no "auto")
DRAFT_LENGTH, TREE_NODES, EAGLE_TREE, FIXED_DRAFTS = "draft length", "tree nodes", "eagle tree", "fixed drafts"
# which engine decodes a kind
RUNTIME, TRANSFORMERS, LLAMACPP = "runtime", "transformers", "llamacpp"
_TREE_SHAPE = re.compile(r"[0-9]+x[0-9]+")  # eagle's @N:DEPTHxTOP_K
_P_MIN = re.compile(r"p(0(\.[0-9]*)?|\.[0-9]+)")  # a draft model's @K:pP


@dataclass(frozen=True)
class MethodKind:
    """One registry entry: `arg` names what follows "kind:" (None: the kind takes no argument), `size`
    what "@..." sets (DRAFT_LENGTH, TREE_NODES, EAGLE_TREE or FIXED_DRAFTS; None: no suffix), `engine`
    which engine decodes it (RUNTIME, TRANSFORMERS or LLAMACPP), `load` for a drafter the
    "module:function" that builds it (called as function(spec, target, loader), returning
    generate()'s draft argument; None: no drafter), `chain` whether it drafts chains (only those join
    a hybrid), `varying_blocks` whether its trees change size every step (a compiled warm-up then
    builds every verification block: specdec.tuning.warmup), `gated_members` whether its members may
    go unrun in a warm-up (the composite's gates: each member is then warmed up alone)."""

    arg: str | None
    size: str | None
    engine: str = RUNTIME
    load: str | None = None
    chain: bool = False
    varying_blocks: bool = False
    gated_members: bool = False


METHODS: dict[str, MethodKind] = {
    "plain": MethodKind(None, None),
    "ngram": MethodKind(None, DRAFT_LENGTH, load="specdec.drafters.ngram:from_spec", chain=True),
    "suffix": MethodKind(None, TREE_NODES, load="specdec.drafters.suffix:from_spec", varying_blocks=True),
    "draft": MethodKind("NAME_OR_PATH", DRAFT_LENGTH, load="specdec.drafters.model:from_spec", chain=True),
    "hybrid": MethodKind("NAME_OR_PATH", DRAFT_LENGTH, load="specdec.drafters.hybrid:from_spec"),  # A+B
    "composite": MethodKind(None, None, load="specdec.drafters.composite:from_spec", gated_members=True),  # A|B
    "medusa": MethodKind("DIR", TREE_NODES, load="specdec.drafters.medusa.drafter:from_spec"),
    "eagle": MethodKind("DIR", EAGLE_TREE, load="specdec.drafters.eagle.drafter:from_spec"),
    "hf": MethodKind(None, None, TRANSFORMERS),
    "hf-assisted": MethodKind("NAME_OR_PATH", None, TRANSFORMERS),
    "hf-pld": MethodKind(None, None, TRANSFORMERS),
    "llamacpp": MethodKind(None, None, LLAMACPP),
    "llamacpp-spec": MethodKind("NAME_OR_GGUF", FIXED_DRAFTS, LLAMACPP),
    "llamacpp-eagle3": MethodKind("HEAD_GGUF", FIXED_DRAFTS, LLAMACPP),
}
DRAFTERS = {kind: e for kind, e in METHODS.items() if e.load is not None}
BASELINES = tuple(kind for kind, e in METHODS.items() if e.engine != RUNTIME)  # each names a speedup_vs_ column

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
    `members` (an A+B hybrid's chain drafters, in order; an A|B composite's drafters, kind "composite")
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
        if self.kind == "composite":
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
        """The drafter `text` names (grammar in the module docstring; `parse_method` for any method).
        `bare`: the kind a word without a known kind prefix takes ("draft" on the command lines, where
        `--draft NAME` names a draft model); None = such a word is an error. A ValueError says what is
        wrong with `text`, then shows the grammar."""
        return _parse(text, bare, drafters_only=True)

    def __str__(self) -> str:
        if self.kind == "composite":
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
        if self.kind == "composite":
            return next((m.draft_length for m in self.members if m.draft_length is not None), None)
        return self.size if DRAFTERS[self.kind].size == DRAFT_LENGTH else None

    @property
    def sized_by_k(self) -> bool:
        """Whether the spec drafts chains of the step's draft length k (its own @K or the run's)."""
        return self.kind == "composite" or DRAFTERS[self.kind].size == DRAFT_LENGTH

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
        return frozenset(p.kind for p in (self.members if self.kind == "composite" else self.parts))

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


@dataclass(frozen=True)
class BaselineSpec:
    """A method that is no drafter of this runtime: `kind` "plain" (this runtime's plain decoding) or a
    baseline of BASELINES; `arg` what follows "kind:" (hf-assisted's assistant model, llamacpp-spec's
    draft, llamacpp-eagle3's head GGUF); `size` llamacpp-spec's / llamacpp-eagle3's drafts per step
    (an integer; None = the run's). Checked on construction."""

    kind: str
    arg: str | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        entry = METHODS.get(self.kind)
        if entry is None or entry.load is not None:
            raise ValueError(f"unknown method {self.kind!r}; a method is {METHOD_GRAMMAR}")
        if entry.arg is not None and not self.arg:
            raise ValueError(f"method {self.kind!r} needs a model: write {self.kind}:{entry.arg}")
        if entry.arg is None and self.arg:
            raise ValueError(f"method {self.kind!r} takes no argument, got {self.kind}:{self.arg}")
        if isinstance(self.arg, str):
            check_path_length(f"method {self.kind}'s {entry.arg}", self.arg)
        if self.size is not None:
            if entry.size != FIXED_DRAFTS:
                takes = ", ".join([*(k for k, e in METHODS.items() if e.size is not None)])
                raise ValueError(f"{self.kind}@{self.size}: only {takes} take a draft length (or tree size) @K")
            if self.size == "auto":
                raise ValueError(f"{self.kind}:{self.arg}@auto: llama.cpp drafts a fixed number of tokens at most: "
                                 "write @K, an integer")
            object.__setattr__(self, "size", parse_draft_length(self.size))

    def __str__(self) -> str:
        text = self.kind if self.arg is None else f"{self.kind}:{self.arg}"
        return text if self.size is None else f"{text}@{self.size}"

    @property
    def draft_length(self) -> int | None:
        """llamacpp-spec's / llamacpp-eagle3's own drafts per step (None: the run's)."""
        return self.size

    @property
    def label(self) -> str | None:
        """The speedup_vs_<label> column this baseline names in a report: its kind, with llama.cpp's
        speculative decoding (which a run may try at several draft lengths) its @K too; None for plain."""
        if self.kind not in BASELINES:
            return None
        return f"{self.kind}@{self.size}" if self.size is not None else self.kind


METHOD_GRAMMAR = ("plain, hf, hf-assisted:NAME_OR_PATH, hf-pld, llamacpp, llamacpp-spec:NAME_OR_GGUF@K, "
                  f"llamacpp-eagle3:HEAD_GGUF@K, or a drafter: {GRAMMAR}")


@dataclass(frozen=True)
class Method:
    """One method of a `specdec eval` run: `name` as written (the report's key), `spec` what it parses
    to, and `k` a draft length in place of the spec's own (a warm-up's; None: the spec's)."""

    name: str
    spec: DrafterSpec | BaselineSpec
    k: int | str | None = None

    @classmethod
    def parse(cls, text: str) -> Method:
        return cls(text.strip(), parse_method(text))

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def engine(self) -> str:
        """Which engine decodes it: RUNTIME, TRANSFORMERS or LLAMACPP."""
        return METHODS[self.spec.kind].engine

    @property
    def drafter(self) -> DrafterSpec | None:
        """The drafter spec of a drafting method (None for plain and the baselines)."""
        return self.spec if isinstance(self.spec, DrafterSpec) else None

    @property
    def draft_length(self) -> int | str | None:
        """The draft length this method runs at in place of the run's: `k`, else the spec's own (a
        drafter's @K, not a tree's nodes; llama.cpp's @K); None = the run's."""
        return self.k if self.k is not None else self.spec.draft_length

    @property
    def label(self) -> str | None:
        """The baseline column it names (BaselineSpec.label), None for plain and the drafters."""
        return self.spec.label if isinstance(self.spec, BaselineSpec) else None


def parse_methods(text: str | list[str] | tuple[str, ...]) -> list[Method]:
    """Methods from "plain,ngram,hf" (or a list); names unique, at most one per baseline column."""
    items = text.split(",") if isinstance(text, str) else list(text)
    methods = [Method.parse(t) for t in items if t.strip()]
    if not methods:
        raise ValueError("no methods given; e.g. --methods plain,ngram,hf")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"methods repeat: {names}")
    labels = [m.label for m in methods if m.label]
    if len(set(labels)) != len(labels):
        raise ValueError(f"at most one method of each baseline kind ({', '.join(BASELINES)}; llamacpp-spec and "
                         "llamacpp-eagle3: one per @K): they name the speedup_vs_<baseline> columns")
    return methods


def parse_method(text: str, bare: str | None = None) -> DrafterSpec | BaselineSpec:
    """The config of the method `text` names (grammar in the module docstring): a DrafterSpec, or a
    BaselineSpec for plain decoding and the baselines; `bare` as in DrafterSpec.parse. A ValueError
    says what is wrong with `text`, then shows the grammar."""
    return _parse(text, bare, drafters_only=False)


def _parse(text: str, bare: str | None, drafters_only: bool) -> DrafterSpec | BaselineSpec:
    if not isinstance(text, str):
        raise TypeError(f"a {'drafter spec' if drafters_only else 'method'} is a string, got {type(text).__name__}")
    name = text.strip()
    try:
        if not name:
            raise ValueError(f"an empty {'drafter spec' if drafters_only else 'method'}")
        if "|" in name:
            return _parse_composite(name, bare)
        return _parse_hybrid(name, bare) if "+" in name else _parse_one(name, bare, drafters_only)
    except ValueError as e:
        grammar = f"a drafter spec is {GRAMMAR}" if drafters_only else f"a method is {METHOD_GRAMMAR}"
        raise ValueError(f"{e}; {grammar}") from e


def _parse_composite(name: str, bare: str | None) -> DrafterSpec:
    parts = [p.strip() for p in name.split("|")]
    if not all(parts):
        raise ValueError(f"{_quote(name)} has an empty drafter beside a '|': a composite joins two or more "
                         "drafters with '|', e.g. suffix|draft:NAME_OR_PATH@auto")
    if any("+" in p for p in parts):
        raise ValueError(f"{_quote(name)}: a composite's members are single drafters; a hybrid (A+B) cannot be one")
    try:
        return DrafterSpec("composite", members=tuple(_parse_one(p, bare, True) for p in parts))
    except ValueError as e:
        raise ValueError(e.args[0] if name in str(e) or _quote(name) in str(e) else f"{_quote(name)}: {e}") from e


def _parse_hybrid(name: str, bare: str | None) -> DrafterSpec:
    parts = [p.strip() for p in name.split("+")]
    if not all(parts):
        where = ("before its first '+'" if not parts[0] else "after its last '+'" if not parts[-1]
                 else "between two '+'")
        raise ValueError(f"{_quote(name)} has an empty drafter {where}: a hybrid joins two or more drafters with "
                         "'+', e.g. ngram+draft:NAME_OR_PATH")
    members = [_parse_one(p, bare, True) for p in parts]
    size = members[-1].size if DRAFTERS[members[-1].kind].size == DRAFT_LENGTH else None
    p_min = members[-1].p_min
    if size is not None:
        members[-1] = DrafterSpec(members[-1].kind, members[-1].arg)
    try:
        return DrafterSpec("hybrid", None, size, None, tuple(members), p_min)
    except ValueError as e:
        raise ValueError(f"{_quote(name)}: {e}") from e


def _parse_one(name: str, bare: str | None, drafters_only: bool) -> DrafterSpec | BaselineSpec:
    """One method without '+' or '|': KIND[:ARG][@SIZE[:DxK | :pP]]."""
    base, at, size = name.rpartition("@")
    size, colon, shape = size.partition(":")
    if at:
        _check_suffix(name, base, size, colon, shape)
    p_min = bool(colon and _P_MIN.fullmatch(shape))
    if not at or not (_digits(size) or size == "auto") or (colon and not p_min and not _TREE_SHAPE.fullmatch(shape)):
        base, at, size, colon, p_min = name, "", "", "", False  # an "@" inside a path is part of the path
    kind, _, arg = base.partition(":")
    value = (int(size) if _digits(size) else size) if at else None
    if kind in METHODS and kind not in DRAFTERS:
        if drafters_only:
            raise ValueError(f"unknown drafter {_quote(name)}")
        if colon:
            raise ValueError(f"{_quote(name)}: only eagle takes a tree shape (@N:DEPTHxTOP_K), and only a draft "
                             "model a probability (:pP)")
        return BaselineSpec(kind, arg or None, value)
    if kind not in DRAFTERS:
        _check_misspelled(name)
        if bare is None:
            raise ValueError(f"unknown {'drafter' if drafters_only else 'method'} {_quote(name)}")
        kind, arg = bare, base
    entry = DRAFTERS[kind]
    if at and entry.size is None:
        raise ValueError(f"{_quote(name)}: {kind} takes no @ suffix")
    if entry.arg == "DIR" and arg:
        _check_dir_suffix(name, kind, arg, bool(at))
    try:
        if p_min:
            return DrafterSpec(kind, arg or None, value, p_min=float(shape[1:]))
        return DrafterSpec(kind, arg or None, value, tuple(map(int, shape.split("x"))) if colon else None)
    except ValueError as e:
        raise ValueError(e.args[0] if name in str(e) or _quote(name) in str(e) else f"{_quote(name)}: {e}") from e


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


def _check_misspelled(name: str) -> None:
    """ValueError for a word without a known kind that reads as a misspelled spec: a known kind before a
    second '@' (`ngram@@3`, `ngram@3@4`) or a kind in other case (`NGRAM`, `Draft:x`). A model path
    spelt so is written with a leading "./"."""
    leading = re.split(r"[@:]", name, maxsplit=1)[0]
    if leading in DRAFTERS and name.count("@") > 1:
        raise ValueError(f"{_quote(name)} has a second '@': a spec takes one '@' suffix, e.g. {leading}@4")
    if leading != leading.lower() and leading.lower() in METHODS:
        raise ValueError(f"unknown drafter kind {leading!r}: kinds are lowercase, write "
                         f"{leading.lower() + name[len(leading):]!r} (a path spelt so: './{name}')")


def _check_dir_suffix(name: str, kind: str, arg: str, sized: bool) -> None:
    """ValueError for an "@" inside a medusa / eagle directory that reads as a misplaced suffix: a
    second '@' (`medusa:DIR@4@5`) or a size that is no valid suffix (`medusa:DIR@x`, `medusa:DIR@-1`).
    A directory whose name holds such an '@' ends in '/' (`medusa:heads@x/`)."""
    if "@" not in arg or arg.endswith("/"):
        return
    tail = arg.rpartition("@")[2]
    if sized or _digits(tail.partition(":")[0]) or tail.partition(":")[0] == "auto":
        raise ValueError(f"{_quote(name)} has a second '@': write {kind}:DIR@N with one '@' (a directory whose name "
                         f"holds an '@' ends in '/')")
    raise ValueError(f"{_quote(name)}: after {kind}'s '@' comes {_SUFFIX[DRAFTERS[kind].size]}, got {tail!r} (a "
                     f"directory whose name holds an '@' ends in '/': {kind}:{arg}/)")


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
