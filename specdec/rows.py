"""Batch bookkeeping shared by every decoding loop: prompts in, per-row outputs, stopping, prefill.

A row is a slot of the target's static KV cache (`runtime.cache.KVCache`). `generate()` fills
every row at once; the serving engine (`specdec.serving.engine`) reuses a row for one request after
another: `RowState.reset` / `RowState.free` and `KVCache.rows`, a view of rows of the cache whose
writes land in the shared buffers.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from runtime.args import check_data, describe
from runtime.cache import KVCache
from runtime.errors import ContextLengthError
from runtime.model_output import ModelOutput


def unwrap_encoding(input_ids, attention_mask: torch.Tensor | None) -> tuple[object, torch.Tensor | None]:
    """A tokenizer's output (a transformers BatchEncoding, or any mapping holding "input_ids") as its
    input_ids and attention_mask (the caller's attention_mask, when given, wins); anything else as it is.
    An encoding of lists (no `return_tensors`) gives its rows as a list, or as padded tensors when its
    mask marks padding."""
    if not isinstance(input_ids, Mapping):
        return input_ids, attention_mask
    if "input_ids" not in input_ids:
        raise TypeError(f"input_ids is a mapping without an 'input_ids' entry (keys {sorted(map(str, input_ids))}); "
                        "pass a tokenizer's output, or the token id tensor itself")
    encoding, input_ids = input_ids, input_ids["input_ids"]
    if attention_mask is None:
        attention_mask = encoding.get("attention_mask")
    if isinstance(input_ids, (list, tuple)):  # lists of ids: one prompt, or one list per prompt
        one = bool(input_ids) and not isinstance(input_ids[0], (list, tuple, torch.Tensor))
        rows = [input_ids] if one else list(input_ids)
        masks = None if attention_mask is None or isinstance(attention_mask, torch.Tensor) else \
            ([attention_mask] if one else list(attention_mask))
        if masks is not None and all(all(v == 1 for v in m) for m in masks):
            return [torch.as_tensor(r) for r in rows], None  # no padding: rows of their own lengths
        if masks is not None:
            return torch.as_tensor(rows), torch.as_tensor(masks)  # padded by the tokenizer: rectangular
        return [torch.as_tensor(r) for r in rows], attention_mask
    return input_ids, attention_mask


def normalize_prompts(input_ids: torch.Tensor | list[torch.Tensor], attention_mask: torch.Tensor | None = None,
                      pad_token_id: int | None = None) -> tuple[list[torch.Tensor], bool]:
    """Rows as 1-D LongTensors on the CPU, and whether the input was a (B, T) tensor.

    input_ids: a (B, T) or (T,) tensor of integer token ids, or a list of 1-D tensors (or lists of
    ids) of their own lengths. A padded (B, T) batch takes its `attention_mask` (0 / 1 of its
    shape, 1 = token, the 0s of a row on one side). Nothing is inferred from `pad_token_id`: a
    tensor without a mask whose row starts or ends with it (left or right padding) is refused
    rather than decoded with the padding as prompt text, one row as much as several."""
    if isinstance(input_ids, torch.Tensor):
        check_data("input_ids", input_ids)
        if input_ids.dim() == 1:  # one prompt (T,), its mask (T,) too
            input_ids = input_ids[None]
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1:
                attention_mask = attention_mask[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a LongTensor [B, T] or a list of 1-D LongTensors, "
                             f"got a tensor of shape {tuple(input_ids.shape)}")
        if input_ids.shape[0] == 0:
            raise ValueError("input_ids holds no rows (shape (0, T)): pass at least one prompt")
        _check_ids("input_ids", input_ids)
        if attention_mask is not None:
            rows = _unpad(input_ids, attention_mask)
        else:
            if pad_token_id is not None:
                _refuse_padding(input_ids, pad_token_id)
            rows = list(input_ids)
        as_tensor = True
    elif isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a (B, T) tensor of input_ids; a list of rows needs none")
        if not input_ids:
            raise ValueError("input_ids is an empty list: pass at least one prompt")
        rows, as_tensor = [_row(i, r) for i, r in enumerate(input_ids)], False
    else:
        raise TypeError(f"input_ids must be a LongTensor [B, T] or a list of 1-D LongTensors, got "
                        f"{describe(input_ids)}")
    for i, r in enumerate(rows):
        if r.numel() == 0:
            raise ValueError(f"input_ids row {i} is empty: every row needs at least one token (e.g. a BOS "
                             "token or a chat template)")
    return [r.long().cpu() for r in rows], as_tensor


def _check_ids(name: str, ids: torch.Tensor) -> None:
    """ValueError unless `ids` holds integer token ids (not bools, not floats)."""
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise ValueError(f"{name} must hold integer token ids (torch.long), got {ids.dtype}")


def _row(i: int, row) -> torch.Tensor:
    """Element `i` of a list input_ids as a 1-D tensor of token ids."""
    if not isinstance(row, torch.Tensor):
        try:
            row = torch.as_tensor(row)
        except (TypeError, ValueError, RuntimeError) as err:  # what torch says of a str, a ragged list, ...
            raise TypeError(f"input_ids[{i}] must be a 1-D LongTensor (or a list of token ids), got "
                            f"{describe(row)}") from err
    check_data(f"input_ids[{i}]", row)
    if row.dim() != 1:
        raise ValueError(f"input_ids[{i}] must be 1-D, got shape {tuple(row.shape)}; a list input_ids holds one "
                         "1-D tensor per prompt ([ids] for one prompt)")
    _check_ids(f"input_ids[{i}]", row)
    return row


def _unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a padded (B, T) batch without their padding, as `attention_mask` marks it."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor of 0 / 1 shaped like input_ids, got "
                        f"{describe(attention_mask)}")
    check_data("attention_mask", attention_mask)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}; they must match")
    mask = attention_mask.to(input_ids.device)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token), got "
                         f"{sorted(set(mask.flatten().tolist()) - {0, 1})[:4]}")
    mask = mask.bool()
    for b, m in enumerate(mask):
        ones = m.nonzero()
        if ones.numel() and int(ones[-1]) - int(ones[0]) + 1 != ones.numel():
            raise ValueError(f"attention_mask row {b} has padding between tokens; each row's padding goes on one "
                             "side (left or right)")
    return [r[m] for r, m in zip(input_ids, mask)]


def _refuse_padding(input_ids: torch.Tensor, pad_token_id: int) -> None:
    """ValueError when a row of `input_ids` starts or ends with `pad_token_id`: padded, but no
    attention_mask says where."""
    padded = ((input_ids[:, 0] == pad_token_id) | (input_ids[:, -1] == pad_token_id)).nonzero()
    if padded.numel():
        raise ValueError(f"input_ids row {int(padded[0])} starts or ends with pad_token_id {pad_token_id} but no "
                         "attention_mask says which tokens are padding: pass attention_mask (1 = token, 0 = padding), "
                         "or the prompts as a list of 1-D tensors of their own lengths")


def check_lengths(rows: list[torch.Tensor], max_new_tokens: int, max_positions: int, vocab_size: int,
                  slack: int = 0) -> int:
    """Validate prompts against the model; returns the cache length needed per row."""
    longest = max(r.numel() for r in rows)
    need = longest + max_new_tokens
    if need > max_positions:
        raise ContextLengthError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
            f"model's {max_positions} positions; shorten the prompt or lower max_new_tokens")
    for i, r in enumerate(rows):
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"input_ids row {i} holds token id {hi if hi >= vocab_size else lo}, outside the "
                             f"model's vocabulary [0, {vocab_size})")
    return min(need + slack, max_positions + slack)


@dataclass
class RowState:
    """Generated tokens and stopping state of each row.

    Every row starts with `max_new_tokens` and the stop tokens `eos`; `reset` gives one row a new
    prompt with its own limit and stop tokens (the engine admitting a request), `free` ends it."""

    prompts: list[torch.Tensor]
    max_new_tokens: int
    eos: frozenset[int]
    new: list[list[int]] = field(init=False)
    done: list[bool] = field(init=False)
    limits: list[int] = field(init=False)
    stops: list[frozenset[int]] = field(init=False)
    seqs: list[torch.Tensor] = field(init=False)  # prompt + new per row, extended once per emit

    def __post_init__(self) -> None:
        self.seqs = list(self.prompts)
        self.new = [[] for _ in self.prompts]
        self.done = [self.max_new_tokens == 0 for _ in self.prompts]
        self.limits = [self.max_new_tokens for _ in self.prompts]
        self.stops = [self.eos for _ in self.prompts]

    def reset(self, row: int, prompt: torch.Tensor, max_new_tokens: int, eos: frozenset[int]) -> None:
        """Start `row` over with `prompt` (1-D), its own token limit and stop tokens."""
        self.prompts[row], self.new[row], self.seqs[row] = prompt, [], prompt
        self.limits[row], self.stops[row] = max_new_tokens, eos
        self.done[row] = max_new_tokens == 0

    def free(self, row: int) -> None:
        """End `row`: it emits nothing more (its slot may be reset for another prompt)."""
        self.done[row] = True

    def emit(self, row: int, tokens: list[int]) -> int:
        """Append tokens to a row up to eos / its token limit; returns how many were kept."""
        kept = 0
        new, stops, limit = self.new[row], self.stops[row], self.limits[row]
        for t in tokens:
            if self.done[row]:
                break
            new.append(t)
            kept += 1
            if t in stops or len(new) >= limit:
                self.done[row] = True
        if kept:
            self.seqs[row] = torch.cat([self.seqs[row], torch.tensor(new[-kept:], dtype=torch.long)])
        return kept

    def budget(self, row: int) -> int:
        """Tokens `row` may still emit."""
        return self.limits[row] - len(self.new[row])

    @property
    def all_done(self) -> bool:
        return all(self.done)

    def active(self) -> list[int]:
        return [b for b, d in enumerate(self.done) if not d]

    def sequences(self) -> list[torch.Tensor]:
        """Every row's prompt + new tokens (kept up to date by `emit`: no per-call rebuild; read only)."""
        return list(self.seqs)


MIN_SHARED = 16  # leading tokens a prompt must share with an earlier one of its batch to copy its keys


def prefill_sharing(model, rows: list[torch.Tensor], cache, return_hidden: bool = False) -> ModelOutput:
    """`prefill` (without aux states), except that a prompt sharing at least MIN_SHARED leading
    tokens with an earlier prompt of the batch copies that prompt's keys and values and prefills
    only the rest after them (`prefill_after`): a common prefix (a system prompt, n samples of one
    prompt) is prefilled once. Exact on a row-invariant model: a split prompt keeps its bits."""
    sources: dict[int, tuple[int, int]] = {}  # row -> (the earlier row it copies, tokens copied)
    groups: dict[tuple[int, ...], list[int]] = {}  # first MIN_SHARED tokens -> the rows starting with them
    for b, r in enumerate(rows):
        if r.numel() <= MIN_SHARED:
            continue
        group = groups.setdefault(tuple(r[:MIN_SHARED].tolist()), [])
        # the group's first row and its last so far: linear in the batch (6000 samples of one prompt)
        candidates = {group[0], group[-1]} if group else set()
        shared, a = max(((common_prefix(rows[a], r), a) for a in candidates), default=(0, -1))
        if min(shared, r.numel() - 1) >= MIN_SHARED:
            sources[b] = (a, min(shared, r.numel() - 1))
        group.append(b)
    if not sources or not isinstance(cache, KVCache):  # a transformers model's cache has no rows to copy
        return prefill(model, rows, cache, return_hidden)
    outs: dict[int, ModelOutput] = {}
    for run in runs([b for b in range(len(rows)) if b not in sources]):
        out = prefill(model, [rows[b] for b in run], cache.rows(run[0], len(run)), return_hidden)
        for i, b in enumerate(run):
            outs[b] = ModelOutput(out.logits[i:i + 1], None if out.hidden is None else out.hidden[i:i + 1])
    for b, (a, n) in sorted(sources.items()):  # a < b: a leader, or a row copied before this one
        cache.share(a, b, n)
        row = cache.rows(b)
        row.lengths.fill_(n)
        outs[b] = prefill_after(model, rows[b][n:], row, return_hidden)
    ordered = [outs[b] for b in range(len(rows))]
    hidden = None if ordered[0].hidden is None else torch.cat([o.hidden for o in ordered])  # (B, C)
    return ModelOutput(torch.cat([o.logits for o in ordered]), hidden)  # (B, V), (B, C)


def prefill_after(model, tail: torch.Tensor, cache, return_hidden: bool = False,
                  aux_layers: tuple[int, ...] = ()) -> ModelOutput:
    """Prefill the rest of one prompt: `cache` is one row (`KVCache.rows`) that already holds the
    keys and values of the prompt's first L tokens (a cached prefix); `tail` (T,) are the tokens
    after them, written at slots L .. L+T-1. Eager (a compiled model compiles no program of T).
    On a row-invariant model the result equals a prefill of the whole prompt, bit for bit.
    Returns what `prefill` returns for that row: logits (1, V) of the last token, its hidden state
    (1, C), aux states (1, T, nC) of the tail's positions."""
    if cache.batch_size != 1 or tail.dim() != 1 or tail.numel() == 0:
        raise ValueError(f"prefill_after continues one cache row with a non-empty 1-D tail, got "
                         f"{cache.batch_size} rows and a tail of shape {tuple(tail.shape)}")
    device = model.device
    start, T = int(cache.lengths[0]), tail.numel()
    positions = (start + torch.arange(T, device=device))[None]  # (1, T)
    out = model(tail.to(device)[None], positions, cache, return_hidden=return_hidden,
                logits_idx=torch.tensor([[T - 1]], device=device), aux_layers=aux_layers, eager=True)
    hidden = None if out.hidden is None else out.hidden[:, T - 1]  # (1, C)
    return ModelOutput(out.logits[:, 0], hidden, out.aux)  # (1, V), (1, C), (1, T, nC)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens the 1-D token sequences `a` and `b` share."""
    n = min(a.numel(), b.numel())
    return int((a[:n] == b[:n]).long().cumprod(0).sum()) if n else 0


def _stack_rows(outs: list[ModelOutput], T: int) -> ModelOutput:
    """One prefill output from per-row ones: logits (1, V), hidden (1, C), aux (1, T_b, nC) each ->
    (B, V), (B, C), (B, T, nC) zero-padded past each row's length (None stays None)."""
    hidden = None if outs[0].hidden is None else torch.cat([o.hidden for o in outs])
    aux = None if outs[0].aux is None else torch.cat([  # pad each row to T positions
        torch.nn.functional.pad(o.aux, (0, 0, 0, T - o.aux.shape[1])) for o in outs])
    return ModelOutput(torch.cat([o.logits for o in outs]), hidden, aux)


def runs(rows: list[int]) -> list[list[int]]:
    """Sorted rows split into runs of consecutive rows ([0, 1, 3] -> [[0, 1], [3]])."""
    out: list[list[int]] = []
    for r in sorted(rows):
        if out and out[-1][-1] == r - 1:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def eos_set(eos_token_id: int | list[int] | None) -> frozenset[int]:
    """The stop tokens: None, one token id, or a list of ids (not a string: "108" is no id)."""
    if eos_token_id is None:
        return frozenset()
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple, set, frozenset)) else [eos_token_id]
    try:
        if any(isinstance(e, bool) for e in ids):
            raise TypeError("a bool is no token id")
        out = frozenset(operator.index(e) for e in ids)
    except TypeError as err:
        raise ValueError(f"eos_token_id must be a token id (int) or a list of ids, got {eos_token_id!r}") from err
    if any(e < 0 for e in out):
        raise ValueError(f"eos_token_id must hold token ids >= 0, got {eos_token_id!r}")
    return out


def prefill(model, rows: list[torch.Tensor], cache, return_hidden: bool = False, aux_layers: tuple[int, ...] = (),
            eager: bool = False) -> ModelOutput:
    """Run the prompts (right-padded) through `model` into `cache`; rows keep their true lengths.

    Returns a ModelOutput: the logits of each row's last prompt token (B, V), its final hidden state
    (B, C) with `return_hidden`, and the states entering `aux_layers` at every prompt position
    (B, T, nC) when it names some (padding positions past a row's length hold padding).
    eager: run the forward eagerly even on a compiled model (`Transformer.forward`'s `eager`; the
    cache rows must be empty), so a one-row prefill compiles no program of its own batch size.
    On a row-invariant model (`Transformer.row_invariant`) every row is prefilled on its own and
    eagerly, so a prompt's prefill is one computation however many prompts share the call.
    """
    if getattr(model, "row_invariant", False):
        eager = eager or model.compiled
        if len(rows) > 1:
            outs = [prefill(model, [r], cache.rows(b), return_hidden, aux_layers, eager=True)
                    for b, r in enumerate(rows)]
            return _stack_rows(outs, max(r.numel() for r in rows))
    device = model.device
    lens = torch.tensor([r.numel() for r in rows], device=device)  # (B,)
    T = int(lens.max())
    tokens = torch.zeros(len(rows), T, dtype=torch.long, device=device)  # (B, T)
    for b, r in enumerate(rows):
        tokens[b, :r.numel()] = r.to(device)
    positions = torch.arange(T, device=device)[None].expand(len(rows), -1)  # (B, T)
    if eager and bool(cache.lengths.any()):
        raise ValueError("an eager prefill writes into empty cache rows; reset their lengths first")
    out = model(tokens, positions, cache, return_hidden=return_hidden, logits_idx=(lens - 1)[:, None],
                aux_layers=aux_layers, eager=eager)
    cache.rollback(lens)  # drop the padding slots: causal masking kept them out of real rows
    hidden = None if out.hidden is None else out.hidden[torch.arange(len(rows), device=device), lens - 1]  # (B, C)
    return ModelOutput(out.logits[:, 0], hidden, out.aux)  # (B, V), (B, C), (B, T, nC)
