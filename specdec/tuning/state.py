"""What drafters made from method strings learn across generate() calls, in one object passed in.

A `TuningState` holds the suffix drafters' caches of earlier responses (one per bound and depth), their
node calibrations (one per config) and the composite drafters' member records (one list per
composite spec text, `specdec.tuning.gates`).
`specdec.loader.DrafterLoader` hands them to the drafters it builds; whoever owns the loader owns
the state: `specdec eval` keeps one per method (so no method drafts from another's answers), the
serving engine one for its drafter, and generate()'s default loader the process's
(`process_state()`), so that repeated generate(draft="suffix") calls learn from earlier answers.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable

from specdec.drafters.suffix import SuffixCache
from specdec.tuning.costs import NodeCalibration
from specdec.tuning.gates import MemberRecord


class TuningState:
    """Suffix caches, node calibrations and composite records, created on first use and kept.
    `answers`: token ids of earlier answers every suffix cache starts with (a resumed `specdec eval`
    method's), and holds again after `forget_answers`. Thread-safe."""

    def __init__(self, answers: Iterable[Iterable[int]] = ()) -> None:
        self.answers = [list(a) for a in answers]
        self._caches: dict[tuple[int, int], SuffixCache] = {}
        self._records: dict[str, list[MemberRecord]] = {}
        self._calibrations: dict[Hashable, NodeCalibration] = {}
        self._lock = threading.Lock()

    def suffix_cache(self, depth: int, max_tokens: int) -> SuffixCache:
        """The cache of earlier responses of this depth and bound (made with `answers` in it)."""
        with self._lock:
            cache = self._caches.get((max_tokens, depth))
            if cache is None:
                cache = self._caches[max_tokens, depth] = self._refill(SuffixCache(max_tokens, depth))
            return cache

    def node_calibration(self, key: Hashable) -> NodeCalibration:
        """How often the nodes of the drafters made with `key` (a kind and its config) were accepted,
        by their probability (`specdec.tuning.costs.NodeCalibration`), over every call so far."""
        with self._lock:
            return self._calibrations.setdefault(key, NodeCalibration())

    def composite_records(self, name: str, members: int) -> list[MemberRecord]:
        """The records of the composite spelt `name` (its spec text), one per member."""
        with self._lock:
            records = self._records.setdefault(name, [MemberRecord() for _ in range(members)])
        if len(records) != members:
            raise ValueError(f"composite {name!r} has {members} members but its records hold {len(records)}")
        return records

    def forget_answers(self) -> None:
        """Empty every suffix cache back to `answers` (after a warm-up, whose answers are no run's)."""
        with self._lock:
            for cache in self._caches.values():
                cache.clear()
                self._refill(cache)

    def _refill(self, cache: SuffixCache) -> SuffixCache:
        for ids in self.answers:
            cache.add(ids)
        return cache


_PROCESS = TuningState()


def process_state() -> TuningState:
    """The process's state: what generate()'s default loader shares between calls."""
    return _PROCESS
