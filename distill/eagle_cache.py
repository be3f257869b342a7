"""The EAGLE-3 feature cache: what one frozen target pass over self-distillation records gives a head.

The states come from the generation of the records itself (`distill.generate_selfdistill` with
`eagle_cache`, recorded by `specdec.capture.StateCapture`: no second pass), or, for records
generated without it, from `cache_eagle_states`, which runs the target once per record (prompt +
the target's own answer, no gradients) asking for its aux layers (`Transformer.forward(aux_layers=)`).
Either way it stores, per record:

- `aux` (L, 3C): the states entering the three aux layers at every position of the sequence
  (what `Eagle3Head.fuse` reads), L = prompt + answer tokens;
- `hidden` (n, C): the final-norm hidden state at the last prompt token and every answer token but
  the last (n = answer tokens; the same positions as the Medusa cache), from which training computes
  the target's next-token distribution over the draft vocabulary (its LM head rows of the draft ids):
  a full-vocabulary distribution per position would be 50-100x larger;
- `tokens` (L,) and the record's lengths.

Shards are safetensors files (bf16 states by default) of about `shard_tokens` positions:
`aux` (N, 3C), `hidden` (M, C), `tokens` (N,) int64, `lengths` (R,) and `prompt_lengths` (R,)
int64, records in order. Every `heldout_every`-th record goes to the held-out split (0: none). Resumable as
the Medusa cache is (distill.train_medusa.HiddenCacheWriter): shards are written atomically, each
followed by the manifest, whose `records_done` counts exactly the records on disk, and a cache of
other records (by the last cached record's id) is refused rather than extended. Nothing is created
before there is something to store: a run refused on its arguments, or given no records, leaves no
empty cache directory behind.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.atomic import atomic_write, atomic_write_text
from runtime.outputs import prepare_manifest_dir
from runtime.progress import progress

MANIFEST = "manifest.json"
FORMAT = "eagle3-features"
CACHE = "EAGLE-3 feature cache"
SPLITS = ("train", "heldout")


def check_eagle_cache_dir(cache_dir: str | Path) -> Path:
    """Fail (OutputPathError) unless `cache_dir` is new, empty or an EAGLE-3 feature cache."""
    return prepare_manifest_dir(cache_dir, MANIFEST, CACHE, lambda m: m.get("format") == FORMAT,
                                f"is not the manifest of an {CACHE} written by specdec (a Medusa hidden-state "
                                "cache is another format); choose a new or empty directory")


class EagleCacheWriter:
    """Appends the features of records, in record order, to an EAGLE-3 feature cache directory.

    `add` buffers a record; buffers are written as shards of about `shard_tokens` positions, each
    followed by the manifest. Call `flush()` to write what is buffered. The directory and its split
    folders are created with the first shard or manifest, not by the constructor.
    """

    def __init__(self, out_dir: str | Path, hidden_size: int, aux_layers: tuple[int, ...], heldout_every: int = 20,
                 shard_tokens: int = 32768, dtype: torch.dtype = torch.bfloat16) -> None:
        if heldout_every < 0 or shard_tokens < 1:
            raise ValueError(f"heldout_every must be >= 0 (0: hold nothing out) and shard_tokens >= 1, got "
                             f"{heldout_every}, {shard_tokens}")
        self.out_dir = check_eagle_cache_dir(out_dir)
        path = self.out_dir / MANIFEST
        self.manifest = json.loads(path.read_text()) if path.is_file() else {
            "format": FORMAT, "hidden_size": hidden_size, "aux_layers": list(aux_layers),
            "heldout_every": heldout_every, "records_done": 0, "last_id": None, "shards": {s: [] for s in SPLITS}}
        m = self.manifest
        if (m["hidden_size"], tuple(m["aux_layers"]), m["heldout_every"]) != (hidden_size, tuple(aux_layers),
                                                                             heldout_every):
            raise ValueError(f"{self.out_dir} caches hidden size {m['hidden_size']}, aux layers {m['aux_layers']}, "
                             f"every {m['heldout_every']}th record held out; this run asks for {hidden_size}, "
                             f"{list(aux_layers)}, {heldout_every}: use another cache directory")
        self.heldout_every, self.shard_tokens, self.dtype = heldout_every, shard_tokens, dtype
        self.buf: dict[str, list[dict[str, torch.Tensor]]] = {s: [] for s in SPLITS}
        self.pending = 0  # records added since the last manifest write
        self.last_id = m["last_id"]

    @property
    def records_done(self) -> int:
        """Records added so far (on disk after `flush()`)."""
        return self.manifest["records_done"] + self.pending

    def check_continues(self, records: list[dict]) -> None:
        """Fail unless the cache's records are the first `records_done` of `records`."""
        n = self.records_done
        if n > len(records) or (n and records[n - 1].get("id") != self.last_id):
            raise ValueError(f"{self.out_dir} caches {n} records ending with id {self.last_id!r}, which are not the "
                             f"first {n} of these {len(records)} records: the cache belongs to other data; use a "
                             "new cache directory")

    def add(self, record: dict, aux: torch.Tensor, hidden: torch.Tensor) -> None:
        """aux (L, 3C): the aux states at every position of prompt + answer, or (L - 1, 3C) without
        the last answer token's (generation never runs that token: `StateCapture`;
        no training step reads it, and it is stored as zeros); hidden (n, C): the final-norm states
        at the last prompt token and every answer token but the last. A record with no answer (or no
        prompt) stores nothing but still counts."""
        P, n = len(record["prompt_ids"]), len(record["output_ids"])
        if n and P:
            if aux.shape[0] == P + n - 1:
                aux = torch.cat([aux, aux.new_zeros(1, aux.shape[1])])
            if aux.shape[0] != P + n or hidden.shape[0] != n:
                raise ValueError(f"record {record.get('id')}: {aux.shape[0]} aux / {hidden.shape[0]} hidden states "
                                 f"for {P} prompt and {n} answer tokens")
            split = "heldout" if self.heldout_every and self.records_done % self.heldout_every == 0 else "train"
            self.buf[split].append({
                "aux": aux.to("cpu", self.dtype), "hidden": hidden.to("cpu", self.dtype),
                "tokens": torch.tensor(record["prompt_ids"] + record["output_ids"], dtype=torch.long),
                "lengths": torch.tensor([P + n]), "prompt_lengths": torch.tensor([P])})
        self.pending += 1
        self.last_id = record.get("id")
        if any(sum(r["aux"].shape[0] for r in rs) >= self.shard_tokens for rs in self.buf.values()):
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
def cache_eagle_states(target, records: list[dict], out_dir: str | Path, aux_layers: tuple[int, ...],
                       heldout_every: int = 20, batch_tokens: int = 4096, shard_tokens: int = 32768,
                       dtype: torch.dtype = torch.bfloat16, deadline: float | None = None) -> Path:
    """Store the aux and final-norm states of `records` ({"id", "prompt_ids", "output_ids"},
    distill.selfdistill) under `out_dir` (see the module docstring). Records the cache already holds
    are skipped; `deadline` (time.monotonic()) stops before the next batch, and the cache then holds
    the records done so far (its manifest is written even when that is none of them). No records:
    nothing is created. Returns `out_dir`."""
    writer = EagleCacheWriter(out_dir, target.config.hidden_size, aux_layers, heldout_every, shard_tokens, dtype)
    writer.check_continues(records)
    todo = records[writer.records_done:]
    bar = progress(total=len(todo), desc="caching EAGLE-3 features", unit="record", disable=not todo)
    device = target.device
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
            out = target(tokens.to(device), positions.to(device), None, return_hidden=True,
                         aux_layers=tuple(aux_layers),
                         logits_idx=torch.zeros(len(seqs), 1, dtype=torch.long, device=device))
            for b, (r, s) in enumerate(zip(batch, seqs)):
                P = len(r["prompt_ids"])
                answer = out.hidden[b, P - 1:len(s) - 1] if P else out.hidden[b, :0]  # (n, C)
                writer.add(r, out.aux[b, :len(s)], answer)  # aux (L, 3C)
            bar.update(len(batch))
    finally:  # also when stopped (Ctrl-C, SIGTERM): what was computed is kept
        writer.flush()
        bar.close()
    if records and not (writer.out_dir / MANIFEST).is_file():  # the deadline came before the first batch
        writer.write_manifest()
    return Path(out_dir)


@dataclass
class EagleSplit:
    """One split of a feature cache in memory: aux (N, 3C), hidden (M, C), tokens (N,), and per
    record its length L and prompt length P (R,); `record(i)` slices record i."""

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
        return cls(**{k: torch.cat([getattr(s, k) for s in splits]) for k in
                      ("aux", "hidden", "tokens", "lengths", "prompt_lengths")})

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


def read_manifest(data_dir: str | Path) -> dict:
    """The manifest of feature cache `data_dir` (ValueError when it is not one)."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise ValueError(f"{data_dir} is not an {CACHE} (no {MANIFEST}); build one with cache_eagle_states or "
                         "`specdec eagle train`")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not the manifest of an {CACHE}")
    return manifest


def load_split(data_dir: str | Path, split: str) -> EagleSplit:
    """Every shard of `split` ("train" or "heldout") of a feature cache, concatenated."""
    names = read_manifest(data_dir)["shards"][split]
    if not names:
        raise ValueError(f"{data_dir} has no {split} records; generate or cache more self-distillation data")
    parts: dict[str, list[torch.Tensor]] = {}
    for name in names:
        with safe_open(str(Path(data_dir) / split / name), framework="pt") as f:
            for key in f.keys():
                parts.setdefault(key, []).append(f.get_tensor(key))
    return EagleSplit(**{k: torch.cat(v) for k, v in parts.items()})
