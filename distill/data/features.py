"""The feature cache: the states of one frozen target pass over self-distillation records, on disk,
which Medusa and EAGLE-3 heads train on without running the target again.

The states come from the generation of the records itself (`distill.data.selfdistill` with a cache,
recorded by `specdec.capture.StateCapture`: no second pass), or, for records generated without one,
from `cache_features`, which runs the target over batches of records (prompt + the target's own
answer, no gradients). A layout says what a record stores:

- `MedusaLayout`, a "hidden-state cache": at every answer position t (the last prompt token and
  every answer token but the last) the final-norm hidden state, `hidden` (n, C), and the targets of
  the K heads, `targets` (n, K): token t+2+i for head i, -100 past the end. Manifest keys
  `num_heads`, `hidden_size`. Read with `load_cached`.
- `EagleLayout`, an "EAGLE-3 feature cache": `aux` (L, 3C), the states entering the three aux layers
  at every position of the sequence (what `Eagle3Head.fuse` reads; L = prompt + answer tokens);
  `hidden` (n, C) at the answer positions as above, from which training computes the target's
  next-token distribution over the draft vocabulary (a full-vocabulary distribution per position
  would be 50-100x larger); `tokens` (L,) and the record's `lengths` and `prompt_lengths` (R,).
  Manifest keys `format` ("eagle3-features"), `hidden_size`, `aux_layers`. Read with `load_split`.

Both layouts share one writer (`FeatureWriter`): shards are safetensors files (bf16 states by
default) of about `shard_rows` rows (positions for Medusa, tokens for EAGLE-3), records in order,
every `heldout_every`-th record in the held-out split (0: none). Each shard is written atomically
and followed by the manifest (`manifest.json`), whose `records_done` counts exactly the records on
disk: a killed run redoes only the records after it, and a cache of other records (by the last
cached record's id) is refused rather than extended. Nothing is created before there is something
to store: a run refused on its arguments, or given no records, leaves no empty cache behind.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.atomic import atomic_write, atomic_write_text
from runtime.output_paths import prepare_manifest_dir
from runtime.progress import progress

MANIFEST = "manifest.json"
SPLITS = ("train", "heldout")
IGNORE = -100  # a head target past the end of the answer


def head_targets(seq: torch.Tensor, start: int, num_heads: int) -> torch.Tensor:
    """Targets (T, K) for positions start .. len-2 of `seq`: head i at t predicts seq[t+2+i]."""
    L = seq.numel()
    t = torch.arange(start, L - 1)[:, None] + 2 + torch.arange(num_heads)[None]  # (T, K)
    return torch.where(t < L, seq[t.clamp(max=L - 1)], torch.full_like(t, IGNORE))


@dataclass(frozen=True)
class MedusaLayout:
    """Medusa's hidden-state cache: final-norm states and the targets of `num_heads` heads."""

    num_heads: int
    hidden_size: int

    what: ClassVar[str] = "hidden-state cache"
    desc: ClassVar[str] = "caching hidden states"
    rows: ClassVar[str] = "hidden"  # the tensor whose rows fill a shard
    aux_layers: ClassVar[tuple[int, ...]] = ()  # the target's forward is asked for none

    @staticmethod
    def recognises(manifest: dict) -> bool:
        """Whether `manifest` is the manifest of a hidden-state cache."""
        return {"num_heads", "hidden_size", "records_done", "shards"} <= set(manifest)

    refusal: ClassVar[str] = (f"is not the manifest of a {what} written by specdec; choose a new or empty directory "
                              "for the cache")

    def identity(self) -> dict:
        """The manifest keys that say which target and heads the cache is for."""
        return {"num_heads": self.num_heads, "hidden_size": self.hidden_size}

    def adopt(self, manifest: dict, heldout_every: int, where: Path) -> MedusaLayout:
        """This layout as the existing cache `manifest` has it (its own head count, at least ours:
        every shard keeps the same target columns); ValueError when the cache is another model's."""
        if manifest["num_heads"] < self.num_heads or manifest["hidden_size"] != self.hidden_size:
            raise ValueError(f"{where} caches hidden states for {manifest['num_heads']} heads / hidden size "
                             f"{manifest['hidden_size']}; use another directory for this model")
        if manifest.get("heldout_every", heldout_every) != heldout_every:
            raise ValueError(f"{where} holds out every {manifest['heldout_every']}th record, not every "
                             f"{heldout_every}th; use another directory")
        return MedusaLayout(manifest["num_heads"], self.hidden_size)

    def tensors(self, record: dict, hidden: torch.Tensor, aux: torch.Tensor | None,
                dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """hidden (n, C) at the answer positions (n = answer tokens) -> a record's shard rows; None
        for a record with no answer."""
        seq = torch.tensor(record["prompt_ids"] + record["output_ids"], dtype=torch.long)
        start = len(record["prompt_ids"]) - 1
        if hidden.shape[0] != seq.numel() - 1 - start:
            raise ValueError(f"record {record.get('id')}: {hidden.shape[0]} hidden states for "
                             f"{len(record['output_ids'])} answer tokens")
        if not hidden.shape[0]:
            return None
        return {"hidden": hidden.to("cpu", dtype), "targets": head_targets(seq, start, self.num_heads)}


@dataclass(frozen=True)
class EagleLayout:
    """EAGLE-3's feature cache: the aux layers' states, final-norm states and tokens of each record."""

    hidden_size: int
    aux_layers: tuple[int, ...]

    what: ClassVar[str] = "EAGLE-3 feature cache"
    desc: ClassVar[str] = "caching EAGLE-3 features"
    rows: ClassVar[str] = "aux"
    format: ClassVar[str] = "eagle3-features"

    @staticmethod
    def recognises(manifest: dict) -> bool:
        """Whether `manifest` is the manifest of an EAGLE-3 feature cache."""
        return manifest.get("format") == EagleLayout.format

    refusal: ClassVar[str] = (f"is not the manifest of an {what} written by specdec (a Medusa hidden-state cache "
                              "is another format); choose a new or empty directory")

    def identity(self) -> dict:
        return {"format": self.format, "hidden_size": self.hidden_size, "aux_layers": list(self.aux_layers)}

    def adopt(self, manifest: dict, heldout_every: int, where: Path) -> EagleLayout:
        """This layout, when the existing cache `manifest` is one of it; else ValueError."""
        m = manifest
        if (m["hidden_size"], tuple(m["aux_layers"]), m["heldout_every"]) != (self.hidden_size, self.aux_layers,
                                                                             heldout_every):
            raise ValueError(f"{where} caches hidden size {m['hidden_size']}, aux layers {m['aux_layers']}, "
                             f"every {m['heldout_every']}th record held out; this run asks for {self.hidden_size}, "
                             f"{list(self.aux_layers)}, {heldout_every}: use another cache directory")
        return self

    def tensors(self, record: dict, hidden: torch.Tensor, aux: torch.Tensor | None,
                dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """aux (L, 3C): the aux states at every position of prompt + answer, or (L - 1, 3C) without the
        last answer token's (generation never runs that token: `StateCapture`; no training step reads
        it, and it is stored as zeros); hidden (n, C) at the answer positions. None for a record with
        no answer (or no prompt)."""
        P, n = len(record["prompt_ids"]), len(record["output_ids"])
        if not (n and P):
            return None
        if aux.shape[0] == P + n - 1:
            aux = torch.cat([aux, aux.new_zeros(1, aux.shape[1])])
        if aux.shape[0] != P + n or hidden.shape[0] != n:
            raise ValueError(f"record {record.get('id')}: {aux.shape[0]} aux / {hidden.shape[0]} hidden states "
                             f"for {P} prompt and {n} answer tokens")
        return {"aux": aux.to("cpu", dtype), "hidden": hidden.to("cpu", dtype),
                "tokens": torch.tensor(record["prompt_ids"] + record["output_ids"], dtype=torch.long),
                "lengths": torch.tensor([P + n]), "prompt_lengths": torch.tensor([P])}


Layout = MedusaLayout | EagleLayout


def check_cache_dir(cache_dir: str | Path, layout: type[Layout]) -> Path:
    """Fail (OutputPathError) unless `cache_dir` is new, empty or a cache of `layout`; create nothing."""
    return prepare_manifest_dir(cache_dir, MANIFEST, layout.what, layout.recognises, layout.refusal)


class FeatureWriter:
    """Appends the states of records, in record order, to a feature cache directory of `layout`.

    `add` buffers a record; buffers are written as shards of about `shard_rows` rows, each followed
    by the manifest. Call `flush()` to write what is buffered. The directory and its split folders
    are created with the first shard or manifest, not by the constructor.
    """

    def __init__(self, out_dir: str | Path, layout: Layout, heldout_every: int = 20, shard_rows: int = 32768,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        if heldout_every < 0 or shard_rows < 1:
            raise ValueError(f"heldout_every must be >= 0 (0: hold nothing out) and the shard size >= 1, got "
                             f"{heldout_every}, {shard_rows}")
        self.out_dir = check_cache_dir(out_dir, type(layout))
        path = self.out_dir / MANIFEST
        self.manifest = json.loads(path.read_text()) if path.is_file() else {
            **layout.identity(), "heldout_every": heldout_every, "records_done": 0, "last_id": None,
            "shards": {s: [] for s in SPLITS}}
        self.layout = layout.adopt(self.manifest, heldout_every, self.out_dir)
        self.heldout_every, self.shard_rows, self.dtype = heldout_every, shard_rows, dtype
        self.buf: dict[str, list[dict[str, torch.Tensor]]] = {s: [] for s in SPLITS}
        self.pending = 0  # records added since the last manifest write
        self.last_id = self.manifest.get("last_id")  # id of the last record added

    @property
    def records_done(self) -> int:
        """Records added so far (on disk after `flush()`)."""
        return self.manifest["records_done"] + self.pending

    def check_continues(self, records: list[dict]) -> None:
        """Fail unless the cache's records are the first `records_done` of `records` (by the last
        cached record's id: a cache of other data is not silently extended)."""
        n = self.records_done
        known = "last_id" in self.manifest  # older hidden-state caches do not record it
        if n > len(records) or (n and known and records[n - 1].get("id") != self.last_id):
            last = f" ending with id {self.last_id!r}" if known else ""
            raise ValueError(f"{self.out_dir} caches {n} records{last}, which are not the first {n} of these "
                             f"{len(records)} records: the cache belongs to other data; use a new cache directory")

    def add(self, record: dict, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> None:
        """Buffer one record's states: hidden (n, C) at the last prompt token and every answer token
        but the last, and (EAGLE-3) aux (L, 3C) at every position (see the layouts). A record with
        nothing to store still counts."""
        tensors = self.layout.tensors(record, hidden, aux, self.dtype)
        if tensors is not None:
            held = self.heldout_every and self.records_done % self.heldout_every == 0
            self.buf["heldout" if held else "train"].append(tensors)
        self.pending += 1
        self.last_id = record.get("id")
        if any(sum(r[self.layout.rows].shape[0] for r in rs) >= self.shard_rows for rs in self.buf.values()):
            self.flush()

    def flush(self) -> None:
        """Write the buffered records as shards, then the manifest; nothing when no record was added
        since the last flush."""
        if not self.pending:
            return
        for split, recs in self.buf.items():
            if not recs:
                continue
            name = f"shard_{len(self.manifest['shards'][split]):05d}.safetensors"
            tensors = {k: torch.cat([r[k] for r in recs]).contiguous() for k in recs[0]}
            atomic_write(self.out_dir / split / name, lambda tmp: save_file(tensors, tmp))
            self.manifest["shards"][split].append(name)
            recs.clear()
        self.manifest["records_done"] += self.pending
        self.manifest["last_id"] = self.last_id
        self.pending = 0
        self.write_manifest()

    def write_manifest(self) -> None:
        """Write the manifest (atomically), creating the directory if needed."""
        atomic_write_text(self.out_dir / MANIFEST, json.dumps(self.manifest, indent=1))


def _batches(records: list[dict], batch_tokens: int) -> Iterator[list[dict]]:
    """Consecutive records grouped so that rows x longest sequence stays within `batch_tokens`."""
    i = 0
    while i < len(records):
        batch, longest = [records[i]], len(records[i]["prompt_ids"]) + len(records[i]["output_ids"])
        while i + len(batch) < len(records):
            nxt = records[i + len(batch)]
            n = len(nxt["prompt_ids"]) + len(nxt["output_ids"])
            if max(longest, n) * (len(batch) + 1) > batch_tokens:
                break
            batch.append(nxt)
            longest = max(longest, n)
        yield batch
        i += len(batch)


@torch.inference_mode()
def cache_features(target, records: list[dict], out_dir: str | Path, layout: Layout, heldout_every: int = 20,
                   batch_tokens: int = 4096, shard_rows: int = 32768, dtype: torch.dtype = torch.bfloat16,
                   deadline: float | None = None) -> Path:
    """Store the states `layout` asks for of `records` ({"id", "prompt_ids", "output_ids"},
    distill.data.selfdistill) under `out_dir`. Records the cache already holds (the first
    `records_done`) are skipped; `deadline` (time.monotonic()) stops before the next batch, and the
    cache then holds the records done so far (its manifest is written even when that is none of
    them). No records: nothing is created. Returns `out_dir`."""
    writer = FeatureWriter(out_dir, layout, heldout_every, shard_rows, dtype)
    writer.check_continues(records)
    todo = records[writer.records_done:]
    bar = progress(total=len(todo), desc=layout.desc, unit="record", disable=not todo)
    device, aux_layers = target.device, tuple(layout.aux_layers)
    try:
        for batch in _batches(todo, batch_tokens):
            if deadline is not None and time.monotonic() > deadline:
                break
            seqs = [r["prompt_ids"] + r["output_ids"] for r in batch]
            longest = max(len(s) for s in seqs)
            tokens = torch.zeros(len(seqs), longest, dtype=torch.long)  # (B, T), right-padded
            for b, s in enumerate(seqs):
                tokens[b, :len(s)] = torch.tensor(s)
            positions = torch.arange(longest)[None].expand(len(seqs), -1)
            out = target(tokens.to(device), positions.to(device), None, return_hidden=True, aux_layers=aux_layers,
                         logits_idx=torch.zeros(len(seqs), 1, dtype=torch.long, device=device))
            for b, (r, s) in enumerate(zip(batch, seqs)):
                P = len(r["prompt_ids"])
                answer = out.hidden[b, P - 1:len(s) - 1] if P else out.hidden[b, :0]  # (n, C)
                writer.add(r, answer, out.aux[b, :len(s)] if aux_layers else None)  # aux (L, 3C)
            bar.update(len(batch))
    finally:  # also when stopped (Ctrl-C, SIGTERM): what was computed is kept
        writer.flush()
        bar.close()
    if records and not (writer.out_dir / MANIFEST).is_file():  # the deadline came before the first batch
        writer.write_manifest()
    return Path(out_dir)


def cache_hidden_states(model, records: list[dict], out_dir: str | Path, num_heads: int, heldout_every: int = 20,
                        batch_tokens: int = 4096, shard_positions: int = 32768, dtype: torch.dtype = torch.bfloat16,
                        deadline: float | None = None) -> Path:
    """`cache_features` for Medusa: the final-norm states and the targets of `num_heads` heads at the
    answer positions of `records` (records the cache already holds, e.g. written during generation by
    `generate_selfdistill(hidden_cache=...)`, are skipped). Returns `out_dir`."""
    return cache_features(model, records, out_dir, MedusaLayout(num_heads, model.config.hidden_size), heldout_every,
                          batch_tokens, shard_positions, dtype, deadline)


def cache_eagle_states(target, records: list[dict], out_dir: str | Path, aux_layers: tuple[int, ...],
                       heldout_every: int = 20, batch_tokens: int = 4096, shard_tokens: int = 32768,
                       dtype: torch.dtype = torch.bfloat16, deadline: float | None = None) -> Path:
    """`cache_features` for EAGLE-3: the states entering `aux_layers` at every position and the
    final-norm states at the answer positions of `records`. Returns `out_dir`."""
    layout = EagleLayout(target.config.hidden_size, tuple(aux_layers))
    return cache_features(target, records, out_dir, layout, heldout_every, batch_tokens, shard_tokens, dtype,
                          deadline)


def read_manifest(data_dir: str | Path, layout: type[Layout] | None = None) -> dict:
    """The manifest of feature cache `data_dir`, of either layout or only of `layout`; ValueError
    when it is none."""
    path = Path(data_dir) / MANIFEST
    kinds = (layout,) if layout is not None else (MedusaLayout, EagleLayout)
    what = " or ".join(f"{'an' if k.what[0] in 'AEIOU' else 'a'} {k.what}" for k in kinds)
    if not path.is_file():
        build = {MedusaLayout: "`specdec medusa data` (distill.cache_hidden_states)",
                 EagleLayout: "cache_eagle_states or `specdec eagle train`"}
        raise ValueError(f"{data_dir} is not {what} (no {MANIFEST}); build one with "
                         f"{' or '.join(build[k] for k in kinds)}")
    manifest = json.loads(path.read_text())
    if not any(k.recognises(manifest) for k in kinds):
        raise ValueError(f"{path} is not the manifest of {what}")
    return manifest


def read_shards(data_dir: str | Path, split: str, keys: tuple[str, ...], layout: type[Layout]) -> dict[str, list]:
    """The tensors `keys` of every shard of `split` ("train" or "heldout") of a `layout` cache, per
    key in shard order; ValueError when `data_dir` is no such cache or holds no record of `split`."""
    names = read_manifest(data_dir, layout)["shards"][split]
    if not names:
        more = "positions; generate more" if layout is MedusaLayout else "records; generate or cache more"
        raise ValueError(f"{data_dir} has no {split} {more} self-distillation data")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    for name in names:
        with safe_open(str(Path(data_dir) / split / name), framework="pt") as f:
            for key in keys:
                parts[key].append(f.get_tensor(key))
    return parts


def load_cached(data_dir: str | Path, split: str, num_heads: int,
                hidden: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """All shards of one split of a hidden-state cache: hidden (N, C) and targets (N, num_heads);
    each record's positions are consecutive rows, in order. hidden=False reads the targets only
    (hidden is then None). ValueError when `data_dir` is not a hidden-state cache, holds targets for
    fewer heads or no positions of `split`."""
    heads = read_manifest(data_dir, MedusaLayout)["num_heads"]
    if heads < num_heads:
        raise ValueError(f"{data_dir} holds targets for {heads} heads, {num_heads} were asked for; rebuild the "
                         "cache with more heads")
    parts = read_shards(data_dir, split, ("targets", "hidden") if hidden else ("targets",), MedusaLayout)
    targets = torch.cat([t[:, :num_heads] for t in parts["targets"]])
    return (torch.cat(parts["hidden"]) if hidden else None), targets


@dataclass
class EagleSplit:
    """One split of an EAGLE-3 feature cache in memory: aux (N, 3C), hidden (M, C), tokens (N,), and
    per record its length L and prompt length P (R,); `record(i)` slices record i."""

    aux: torch.Tensor
    hidden: torch.Tensor
    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor

    def __post_init__(self) -> None:
        zero = torch.zeros(1, dtype=torch.long)
        self.starts = torch.cat([zero, self.lengths.cumsum(0)])  # (R + 1,) rows of aux / tokens
        self.hidden_starts = torch.cat([zero, (self.lengths - self.prompt_lengths).cumsum(0)])  # (R + 1,)

    def __len__(self) -> int:
        return self.lengths.numel()

    @classmethod
    def concat(cls, splits: list[EagleSplit]) -> EagleSplit:
        """The records of `splits`, one after another (features of one target and aux layers)."""
        widths = {(s.aux.shape[1], s.hidden.shape[1]) for s in splits}
        if len(widths) != 1:
            raise ValueError(f"feature caches of different widths (aux, hidden) {sorted(widths)} cannot be "
                             "trained on together: they come from different targets or aux layers")
        if len(splits) == 1:
            return splits[0]
        return cls(**{k: torch.cat([getattr(s, k) for s in splits]) for k in EAGLE_KEYS})

    @property
    def num_positions(self) -> int:
        """Answer positions (rows of `hidden`): where the loss is taken."""
        return self.hidden.shape[0]

    def record(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Record i: aux (L, 3C), hidden (L - P, C), tokens (L,), P."""
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        c, d = int(self.hidden_starts[i]), int(self.hidden_starts[i + 1])
        return self.aux[a:b], self.hidden[c:d], self.tokens[a:b], int(self.prompt_lengths[i])

    def answer_tokens(self) -> torch.Tensor:
        """Every answer token of the split (the tokens the head learns to predict), (M,)."""
        keep = torch.ones(self.tokens.numel(), dtype=torch.bool)
        for a, p in zip(self.starts[:-1].tolist(), self.prompt_lengths.tolist()):
            keep[a:a + p] = False
        return self.tokens[keep]


EAGLE_KEYS = ("aux", "hidden", "tokens", "lengths", "prompt_lengths")


def load_split(data_dir: str | Path, split: str) -> EagleSplit:
    """Every shard of `split` ("train" or "heldout") of an EAGLE-3 feature cache, concatenated."""
    parts = read_shards(data_dir, split, EAGLE_KEYS, EagleLayout)
    return EagleSplit(**{k: torch.cat(v) for k, v in parts.items()})
