"""From a method string to a drafter: `DrafterLoader` loads what a spec names (paths are resolved
here, never when parsing), and `make_drafter` turns generate()'s `draft=` argument into a
`specdec.drafter.Drafter`.

A loader hands the drafters it builds what they learn across calls (suffix caches, composite
records: a `specdec.tuning.state.TuningState`, the process's by default) and, for an
`eagle:DIR@auto` spec, asks its tree tuner (`specdec.tuning.eagle_tree.TreeTuner`) which tree to
use; `specdec eval` and `specdec serve` pass their own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable

import torch

import runtime
from runtime.hf_adapter import HFAdapter
from specdec.drafter import Drafter
from specdec.drafters.composite import CompositeDraft, CompositeDrafter
from specdec.drafters.eagle.drafter import EagleDrafter
from specdec.drafters.eagle.head import Eagle3Head
from specdec.drafters.eagle.io import load_eagle
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.medusa.drafter import MedusaDrafter
from specdec.drafters.medusa.heads import MedusaHeads
from specdec.drafters.medusa.io import load_medusa
from specdec.drafters.model import DraftModel, ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.methods import DrafterSpec
from specdec.tuning.state import TuningState, process_state


class DrafterLoader:
    """Loads what a spec names, each thing once (`cached`). Draft models take `model_options`
    (runtime.load_model's keywords; dtype and device default to the target's); `log` (a callable
    taking a line) reports each load; `state` is the TuningState the drafters share (default: the
    process's); `tuner` picks the tree of an `eagle:DIR@auto` spec (a TreeTuner; None: such a spec
    is refused, there being no prompts to time it on)."""

    def __init__(self, log: Callable[[str], None] | None = None, state: TuningState | None = None,
                 tuner=None, **model_options) -> None:
        self.log, self.tuner, self.model_options = log, tuner, model_options
        self._state = state
        self._cache: dict[tuple, object] = {}

    @property
    def state(self) -> TuningState:
        """The tuning state the drafters this loader builds share."""
        return self._state if self._state is not None else process_state()

    def suffix_cache(self, depth: int, max_tokens: int):
        """The cache of earlier responses a `suffix` drafter of this depth drafts from (`state`'s)."""
        return self.state.suffix_cache(depth, max_tokens)

    def node_calibration(self, key: Hashable):
        """The NodeCalibration the drafters made with `key` (a kind and its config) share (`state`'s)."""
        return self.state.node_calibration(key)

    def composite_records(self, name: str, members: int):
        """What the composite spelt `name` knows of its `members` members (`state`'s)."""
        return self.state.composite_records(name, members)

    def cached(self, key: tuple, load: Callable[[], object]):
        if key not in self._cache:
            self._cache[key] = load()
        return self._cache[key]

    def _say(self, line: str) -> None:
        if self.log is not None:
            self.log(line)

    def model(self, name: str, target):
        """The draft model `name` (a runtime model)."""
        def load():
            options = {"dtype": target.dtype, "device": target.device, **self.model_options}
            self._say(f"loading draft model {name} ({str(options['dtype']).removeprefix('torch.')}, "
                      f"{options['device']}{', compiled' if options.get('compile') else ''})")
            return runtime.load_model(name, **options)

        return self.cached(("model", name), load)

    def medusa(self, path: str, target):
        """Medusa heads from `path` for `target` (one copy per spec: a spec's @N sets their tree)."""
        self._say(f"loading Medusa heads {path}")
        return load_medusa(path, target)

    def eagle_head(self, path: str, target):
        def load():
            self._say(f"loading EAGLE-3 head {path}")
            return load_eagle(path, target)

        return self.cached(("eagle-head", path), load)

    def eagle_auto_tree(self, spec: DrafterSpec, target, head):
        """The tree `eagle:DIR@auto` picks: the tuner's (ValueError without one)."""
        if self.tuner is None:
            raise ValueError(f"{spec}: @auto times tree sizes on prompts, and none were given; write @N (the "
                             "tree's nodes), or time them with specdec eval / specdec serve")
        return self.tuner.tree(spec, target, head)


def as_runtime_model(model):
    """The model itself, or an HFAdapter around a transformers PreTrainedModel. transformers' modeling
    code takes seconds to import, so it is not imported here: a PreTrainedModel exists only once it is."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return HFAdapter(model) if modeling is not None and isinstance(model, modeling.PreTrainedModel) else model


def make_drafter(draft, target, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None, loader: DrafterLoader | None = None) -> Drafter:
    """The drafter for generate()'s `draft` argument: a Drafter (used as is), a spec string such as
    "ngram", "draft:NAME@4" or "eagle:DIR@48" (a DrafterSpec or its text; what it names is loaded
    by `loader`, default a DrafterLoader of the process's tuning state; its own draft length is the
    caller's to apply, see `draft_length_of`), Medusa heads, an EAGLE-3 head, a runtime or
    transformers model, or a list of those tried in order."""
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, CompositeDraft):
        return CompositeDrafter([make_drafter(d, target, temperature, top_k, top_p, generator, loader) for d in draft],
                                draft.records)
    if isinstance(draft, DraftModel):
        return ModelDrafter(as_runtime_model(draft.model), target, temperature, top_k, top_p, generator, draft.p_min)
    if isinstance(draft, (list, tuple)):
        return HybridDrafter([make_drafter(d, target, temperature, top_k, top_p, generator, loader) for d in draft])
    if isinstance(draft, str) and draft == "ngram":
        return NgramDrafter()
    if isinstance(draft, (str, DrafterSpec)):
        spec = DrafterSpec.parse(draft) if isinstance(draft, str) else draft
        return make_drafter(spec.load(target, loader or DrafterLoader()), target, temperature, top_k, top_p, generator)
    if isinstance(draft, MedusaHeads):
        return MedusaDrafter(draft, target)
    if isinstance(draft, Eagle3Head):
        return EagleDrafter(draft, target)
    if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "config"):
        raise TypeError(f"draft must be None, a drafter spec ('ngram', 'draft:NAME', 'eagle:DIR', ...), a model, "
                        f"Medusa or EAGLE-3 heads, a specdec Drafter or a list of those, got {type(draft).__name__}")
    return ModelDrafter(as_runtime_model(draft), target, temperature, top_k, top_p, generator)


def draft_length_of(draft, num_draft_tokens: int | str) -> int | str:
    """The draft length a step uses with `draft`: a spec's own (its @K, e.g. "ngram@3") in place of
    `num_draft_tokens`, else `num_draft_tokens`."""
    if isinstance(draft, str) and draft != "ngram":
        draft = DrafterSpec.parse(draft)
    own = draft.draft_length if isinstance(draft, DrafterSpec) else None
    return num_draft_tokens if own is None else own
