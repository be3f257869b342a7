"""Continuous batching of speculative decoding: requests join and leave a running batch.

The engine keeps one target KV cache of `max_batch` rows for its whole life (by default a
`runtime.paged_cache.PagedKVCache` whose rows take blocks of one pool as they grow and give them
back when they end; with kv_cache_tokens=0 per-row slots: `runtime.cache.KVCache` preallocated
[B, H_kv, S_max, D] with a length per row, so a slot is a row) and one `specdec.decode.DecodeLoop` over it,
the loop `generate()` runs. Each `step()`:

1. retires cancelled requests and admits waiting ones into free rows (with a paged cache, while the
   pool has room for a request's prompt and first step; when it runs out later, the latest admitted
   request is preempted and waits to be admitted again): the newcomers' prompts are
   prefilled into their rows only (`KVCache.rows`, a view of the shared buffers: nothing is
   allocated; one forward per run of consecutive free rows) and the drafter admits each
   (`Drafter.admit`: its own cache slot, hidden state, ...);
2. runs one draft + verify step of every running row together (`DecodeLoop.step`), each row with
   its own sampling settings and torch.Generator (rows with equal settings are verified in one
   call; greedy rows stay exactly greedy);
3. retires rows that hit a stop token or their token limit: the row's cache length drops to 0
   and the drafter releases it, so the slot takes the next request at the next step.

Free rows ride along as finished rows (they write nothing that stays), so the batch keeps its
`max_batch` rows and a compiled target runs the same programs at every step. Drafts are greedy
(the draft model decodes argmax tokens): verification stays lossless for sampled rows (a
deterministic draft is a one-hot q) and a row's random draws come from its own generator only,
so a seeded request gives the same output whatever else is running (with a fixed
num_draft_tokens: under "auto" one AutoK picks k for the whole batch, so a row's draft length, and
with it its draws, depends on the others).

Faults stay with their request. An exception in a request's listener (`on_tokens`), in the
sampling or verification of its tokens (NaN logits, say), in its admission (the prefill of its
prompt, the drafter's `admit`) or in its row's release (the drafter's `release`) ends that request
only: finish_reason "error", `Request.error` saying where and what, its row freed at the end of the
step. The other rows decode on exactly as if it had finished there. A fault of the batch's shared
step (the target's forward over every row, the drafter's `propose` / `commit`) is no one request's:
every request in flight ends with "error", every row is freed, and the next step admits new
requests as at the start.

A request's fault is one warning line in the log (`specdec.serving.engine`: the request's id, the
stage, the exception's type and message); its traceback is logged at debug level.

One thread calls `step()` (or `run_until_done()`); `submit` and `cancel` may come from any
thread. Listeners (`on_tokens`) run on the stepping thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runtime.args import check_data, check_model, describe
from runtime.cache import KVCache
from runtime.errors import CacheMemoryError, ContextLengthError
from runtime.prefix_cache import DEFAULT_BLOCK, PagedPrefixCache, PrefixCache
from specdec.decode import DecodeLoop, cache_slack
from specdec.loader import as_runtime_model, draft_length_of, make_drafter
from specdec.options import DEFAULT_NUM_DRAFT_TOKENS, parse_draft_length
from specdec.rows import RowState, common_prefix, eos_set, runs
from specdec.sampling import RowSampling, SamplingParams
from specdec.stats import AcceptanceStats
from specdec.verify import Verdict

DEFAULT_MAX_LEN = 4096  # cache positions per row when max_len is not given (capped by the model's)
_RECENT = 1024  # finished requests whose TTFT / TPOT feed the latency percentiles of `metrics`
# where a request's fault arose -> how its error message says it
FAULT_STAGES = {"admission": "its admission (the prefill of its prompt, the drafter's admit)",
                "sampling": "the sampling of its tokens", "listener": "its listener (on_tokens)",
                "step": "the batch's decode step (the target's forward, the drafter's propose / commit)",
                "release": "the drafter's release of its row"}
log = logging.getLogger("specdec.serving.engine")


@dataclass(frozen=True)
class RequestError:
    """Why a request ended with finish_reason "error": the stage that raised (one of FAULT_STAGES:
    its admission, the sampling of its tokens, its listener, the batch's shared step, its row's
    release) and the exception's type name and message."""

    stage: str
    type: str
    message: str

    def __post_init__(self) -> None:
        if self.stage not in FAULT_STAGES:
            raise ValueError(f"a request's fault stage is one of {', '.join(FAULT_STAGES)}, got {self.stage!r}")

    @classmethod
    def of(cls, stage: str, err: BaseException) -> RequestError:
        return cls(stage, type(err).__name__, str(err))

    def __str__(self) -> str:
        return f"{self.type} in {FAULT_STAGES[self.stage]}: {self.message}"


@dataclass(eq=False)
class Request:
    """One submitted request, updated by the engine's stepping thread.

    tokens: the new tokens so far. finish_reason: None while waiting or running, then "stop" (a
    stop token, kept as the last token, or `cancel(id, "stop")`), "length" (max_new_tokens),
    "cancelled" or "error" (a fault of this request or of the batch's step: `error` says which).
    ttft_s: submit to first token; tpot_s: per token after the first; target_forwards / drafted /
    accepted: this request's share of the verification steps (AcceptanceStats' conventions);
    preemptions: how often its row was taken for others (a paged cache out of blocks): it waited
    at the head of the queue and was admitted again with its prompt and tokens so far.
    """

    id: str
    prompt: torch.Tensor
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: RequestError | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    on_tokens: Callable[[Request, list[int]], None] | None = field(default=None, repr=False)
    generator: torch.Generator | None = field(default=None, repr=False)
    # target_forwards, drafted, accepted of the rows it ran in before its last preemption
    stats_before: tuple[int, int, int] = field(default=(0, 0, 0), repr=False)

    @property
    def sequence(self) -> torch.Tensor:
        """The prompt and the tokens so far (what a preempted request is admitted again with)."""
        return torch.cat([self.prompt, torch.tensor(self.tokens, dtype=torch.long)]) if self.tokens else self.prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tau(self) -> float:
        """Tokens per target forward of this request (bonus token included)."""
        return len(self.tokens) / self.target_forwards if self.target_forwards else 0.0


class Engine:
    """Continuous batching of speculative (or plain) decoding; see the module docstring.

    target: a runtime Transformer (compiled or not). draft: as generate()'s `draft` (None, a
    model, a drafter spec such as "ngram@3" or "eagle:DIR@16" (specdec.methods; its own draft
    length replaces num_draft_tokens), Medusa heads, an EAGLE-3 head, a list = hybrid, or a Drafter
    whose admit / release are implemented). Requests take a `specdec.sampling.SamplingParams`.
    max_batch: rows decoded together. max_len: prompt + new tokens a request may reach (default:
    the model's positions, at most DEFAULT_MAX_LEN); the cache is sized for it once.
    eos_token_id: stop ids every request gets. prefix_cache_tokens: positions of keys and values
    kept of prompts and answers already read (`runtime.prefix_cache`), so a request prefills only
    what its prompt adds to a cached prefix (None: max_batch x max_len; 0: off; off too for a
    drafter that reads the target's states at every prompt position, EAGLE-3).
    kv_cache_tokens: positions of the paged KV cache (`runtime.paged_cache`) that the rows share:
    each request takes blocks of its pool as it grows and gives them back when it ends, so memory
    follows what the requests hold; a request is admitted when a row is free and the pool has room for
    its prompt and first step, and preempted (then admitted again) if the pool runs out as it grows;
    the prefix cache keeps its blocks in the same pool (None: 2 x
    max_batch x max_len, the memory per-row slots and their prefix pool take; 0: per-row slots of
    max_len positions, the prefix cache a pool of its own beside them).
    """

    def __init__(self, target, draft=None, *, max_batch: int = 4, max_len: int | None = None,
                 num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS,
                 eos_token_id: int | list[int] | None = None, prefix_cache_tokens: int | None = None,
                 kv_cache_tokens: int | None = None) -> None:
        target = as_runtime_model(target)
        check_model("target", target)
        positions = target.config.max_position_embeddings
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        max_len = min(positions, DEFAULT_MAX_LEN) if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 2 <= max_len <= positions:
            raise ValueError(f"max_len must be an integer in [2, {positions}] (the model's positions), got {max_len!r}")
        num_draft_tokens = parse_draft_length(draft_length_of(draft, num_draft_tokens))
        self.target, self.max_batch, self.max_len = target, max_batch, max_len
        self.eos = eos_set(eos_token_id)
        vocab = target.config.vocab_size
        if any(e >= vocab for e in self.eos):
            raise ValueError(f"eos_token_id holds token id {max(self.eos)}, outside the model's vocabulary "
                             f"[0, {vocab}); pass the tokenizer's eos id of this model")
        self.drafter = None if draft is None else make_drafter(draft, target)
        self._slack = cache_slack(target, self.drafter, num_draft_tokens)
        room = max_len + self._slack
        if kv_cache_tokens is None:
            kv_cache_tokens = 2 * max_batch * max_len
        if isinstance(kv_cache_tokens, bool) or not isinstance(kv_cache_tokens, int) or kv_cache_tokens < 0:
            raise ValueError(f"kv_cache_tokens must be an integer >= 0 (0: per-row slots; None: 2 x max_batch x "
                             f"max_len), got {kv_cache_tokens!r}")
        cache = target.new_cache(max_batch, room, paged_tokens=kv_cache_tokens or None)
        if not isinstance(cache, KVCache):
            raise ValueError("the engine serves a runtime Transformer (runtime.load_model); a transformers model's "
                             "cache has no rows to share")
        state = RowState([torch.zeros(0, dtype=torch.long) for _ in range(max_batch)], 0, self.eos)
        self.loop = _IsolatingLoop(target, self.drafter, state, cache, num_draft_tokens, [None] * max_batch)
        if self.drafter is not None:
            self.drafter.reserve(max_batch, room)
        self.prefixes = self._prefix_cache(cache, prefix_cache_tokens)
        self.slots: list[Request | None] = [None] * max_batch
        self._admitted_at = [0] * max_batch  # row -> when its request was admitted (the order preemption follows)
        self._admissions = 0
        self._waiting: collections.deque[Request] = collections.deque()
        self._live: dict[str, Request] = {}
        self._cancel: dict[str, str] = {}  # request id -> the finish reason it is retired with
        self._faults: dict[int, RequestError] = {}  # row -> the fault its request ends with at the step's end
        self._lock = threading.RLock()  # re-entrant: a listener may submit or cancel
        self._counts = collections.Counter(requests_total=0, requests_finished=0, finished_stop=0,
                                           finished_length=0, finished_cancelled=0,
                                           finished_error=0, steps=0, preemptions=0)
        self._prefilled_tokens = 0  # prompt tokens run through the target (not copied from the prefix cache)
        self._ttft: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self._tpot: collections.deque[float] = collections.deque(maxlen=_RECENT)

    @property
    def waiting(self) -> int:
        """Requests queued for a free row."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Rows decoding a request now."""
        return sum(r is not None for r in self.slots)

    def submit(self, prompt_ids, params: SamplingParams = SamplingParams(), *,
               on_tokens: Callable[[Request, list[int]], None] | None = None,
               request_id: str | None = None) -> Request:
        """Queue a request (thread-safe); it joins the batch at a coming step. prompt_ids: (T,) or
        (1, T) token ids, or a list of ints. on_tokens(request, new_ids) is called on the stepping
        thread with the tokens each step accepted, then once with [] when the request finishes
        (not after a cancel); if it raises, the request ends with "error" (its final call comes
        all the same; an exception there is logged). Checked before queueing: a prompt that does
        not fit max_len raises ContextLengthError, bad ids or settings ValueError, an argument of the
        wrong type TypeError. request_id: a unique non-empty str (None: a fresh one)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a specdec.SamplingParams, got {type(params).__name__}")
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"on_tokens must be a callable on_tokens(request, new_ids) or None, got "
                            f"{describe(on_tokens)}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None (a fresh id), got {describe(request_id)}")
        if request_id is not None and not request_id:
            raise ValueError("request_id is empty; pass a non-empty str or None (a fresh id)")
        prompt = self._check_prompt(prompt_ids, params)
        generator = params.generator(self.target.device)
        rid = uuid.uuid4().hex if request_id is None else request_id
        req = Request(rid, prompt, params, on_tokens=on_tokens, generator=generator)
        with self._lock:
            if req.id in self._live:
                raise ValueError(f"request id {req.id!r} is already waiting or running; use a unique id")
            self._live[req.id] = req
            self._waiting.append(req)
            self._counts["requests_total"] += 1
        return req

    def _check_prompt(self, prompt_ids, params: SamplingParams) -> torch.Tensor:
        """The prompt as a 1-D LongTensor on the CPU, checked against the model and max_len."""
        if isinstance(prompt_ids, torch.Tensor):
            check_data("prompt_ids", prompt_ids)
            prompt = prompt_ids
        elif isinstance(prompt_ids, (list, tuple)):
            try:
                prompt = torch.as_tensor(prompt_ids)
            except (TypeError, ValueError, RuntimeError) as err:  # what torch says of strings, ragged lists, ...
                raise TypeError(f"prompt_ids must be a 1-D LongTensor or a list of token ids, got "
                                f"{describe(prompt_ids)}") from err
        else:
            raise TypeError(f"prompt_ids must be a 1-D LongTensor or a list of token ids (tokenize a text first), "
                            f"got {describe(prompt_ids)}")
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(f"prompt_ids must be a non-empty 1-D sequence of token ids, got shape "
                             f"{tuple(prompt.shape)}")
        if prompt.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"prompt_ids must hold integer token ids (torch.long), got {prompt.dtype}")
        vocab = self.target.config.vocab_size
        lo, hi = int(prompt.min()), int(prompt.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"the prompt holds token id {hi if hi >= vocab else lo}, outside the model's "
                             f"vocabulary [0, {vocab})")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the model's vocabulary [0, {vocab})")
        need = prompt.numel() + params.max_new_tokens
        if need > self.max_len:
            raise ContextLengthError(f"prompt ({prompt.numel()} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                                     f"{need} exceeds the engine's max_len ({self.max_len}); shorten the prompt, "
                                     "lower max_new_tokens or start the engine with a larger max_len")
        cache = self.loop.cache
        if cache.block_table is not None and self._blocks_for(prompt.numel(), params) > cache.num_blocks:
            raise ContextLengthError(f"prompt ({prompt.numel()} tokens) + max_new_tokens ({params.max_new_tokens}) "
                                     f"needs more KV positions than the engine's paged cache holds "
                                     f"({cache.num_blocks * cache.block_size}); shorten the prompt, lower "
                                     "max_new_tokens or start the engine with more kv_cache_tokens")
        return prompt.long().cpu()

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Cancel a waiting or running request (thread-safe): it is retired at the next step with
        finish_reason `reason`. "cancelled" (the client went away): its listener is not called
        again; "stop" (the caller found a stop condition of its own, e.g. a stop string in the
        text): it finishes as at a stop token, listener included. Tokens of steps that ran
        before the retirement stay in `tokens`. False if unknown or done."""
        if reason not in ("cancelled", "stop"):
            raise ValueError(f"a request is cancelled with reason 'cancelled' or 'stop', got {reason!r}")
        with self._lock:
            if request_id not in self._live:
                return False
            self._cancel[request_id] = reason
            return True

    def step(self) -> list[Request]:
        """One scheduler step (see the module docstring); returns the requests it finished."""
        finished: list[Request] = []
        with self._lock:
            cancel, self._cancel = self._cancel, {}
            for req in [r for r in self._waiting if r.id in cancel]:
                self._waiting.remove(req)
                self._finish(req, cancel[req.id], finished)
            free = [b for b, r in enumerate(self.slots) if r is None or r.id in cancel]
        for b, req in enumerate(self.slots):
            if req is not None and req.id in cancel:
                self._retire(b, cancel[req.id], finished)
        with self._lock:
            admitted = self._admissible(len(free))
        with torch.inference_mode():
            self._admit(admitted, finished)
            try:
                self._reserve_step(finished)
                emitted = self.loop.step()
            except Exception as err:  # the batch's shared forward or draft: no one request to blame
                emitted = [[] for _ in self.slots]
                self._take_loop_faults()
                self._fail_all(err)
        self._take_loop_faults()
        now = time.perf_counter()
        for b, req in enumerate(self.slots):
            if req is not None and emitted[b] and b not in self._faults:
                self._deliver(req, b, emitted[b], now)
        for b, req in enumerate(self.slots):
            if req is not None and b in self._faults:
                self._retire(b, "error", finished)
            elif req is not None and self.loop.state.done[b]:
                last = req.tokens[-1] if req.tokens else None
                self._retire(b, "stop" if last in self.loop.state.stops[b] else "length", finished)
        with self._lock:  # metrics copies the counters under the lock from other threads
            self._counts["steps"] += 1
        return finished

    def _blocks_for(self, prompt_len: int, params: SamplingParams) -> int:
        """Blocks of the paged cache a request may come to hold: its prompt, its new tokens and the
        slots of one step's drafts (capped by a row's room)."""
        cache = self.loop.cache
        return cache.blocks_needed(min(prompt_len + params.max_new_tokens + self._slack, cache.max_seq_len))

    def _admissible(self, free_rows: int) -> list[Request]:
        """Take the waiting requests that the step admits, first come first served: one per free row,
        and with a paged cache while the pool (its free blocks and the cached ones no row holds) has
        room for the next one's prompt and first step after what the running rows' next step needs.
        A request is not promised the blocks of its whole answer: when the pool runs out, the most
        recently admitted running request is preempted (`_reserve_step`)."""
        cache = self.loop.cache
        if cache.block_table is None:
            return [self._waiting.popleft() for _ in range(min(free_rows, len(self._waiting)))]
        lengths = cache.lengths.tolist()
        running = sum(max(0, cache.blocks_needed(lengths[b] + self._slack) - cache.held(b))
                      for b, r in enumerate(self.slots) if r is not None)
        # cached blocks that no row holds are free memory: a row that needs blocks evicts them
        evictable = self.prefixes.evictable if isinstance(self.prefixes, PagedPrefixCache) else 0
        room = cache.blocks_free + evictable - running
        admitted: list[Request] = []
        while self._waiting and len(admitted) < free_rows:
            need = cache.blocks_needed(self._waiting[0].sequence.numel() + self._slack)
            if need > room:
                break
            room -= need
            admitted.append(self._waiting.popleft())
        return admitted

    def _reserve_step(self, finished: list[Request]) -> None:
        """Give each running row of a paged cache the blocks one step may write (its drafts), the
        earliest admitted first; when the pool has too few, preempt the most recently admitted
        running request (vLLM's recompute preemption) and try again."""
        cache = self.loop.cache
        if cache.block_table is None:
            return
        while True:
            rows = sorted((b for b, r in enumerate(self.slots) if r is not None and not self.loop.state.done[b]),
                          key=lambda b: self._admitted_at[b])
            lengths = cache.lengths.tolist()
            try:
                for b in rows:
                    cache.reserve(b, lengths[b] + self._slack)
                return
            except CacheMemoryError:
                if len(rows) < 2:
                    raise
                self._preempt(rows[-1], finished)

    def _preempt(self, row: int, finished: list[Request]) -> None:
        """Take `row` from its request for the others: its tokens so far stay delivered, its prompt and
        answer go to the prefix cache (so its admission again reuses what is still cached), its row is
        released, and it waits at the head of the queue. A greedy request decodes on exactly as it
        would have (row-invariant forwards); a sampled one keeps its generator but draws differently.
        If the drafter's release of the row raises, the request ends there with "error" (in `finished`)."""
        req = self.slots[row]
        held = int(self.loop.cache.lengths[row])
        if self.prefixes is not None:
            self.prefixes.put(self.loop.state.sequences()[row][:held], self.loop.cache, row)
        s = self.loop.row_stats[row]
        req.stats_before = (req.stats_before[0] + s.target_forwards, req.stats_before[1] + s.drafted_tokens,
                            req.stats_before[2] + s.accepted_tokens)
        req.preemptions += 1
        self.slots[row] = None
        try:
            self.loop.release(row)
        except Exception as err:  # the row is free all the same; the request ends here, as a retired one would
            req.error = RequestError.of("release", err)
            _log_fault(req.id, "could not release its row", req.error, err)
            self.loop.cache.free_row(row, zero=True)
            self._finish(req, "error", finished)
            return
        with self._lock:
            self._waiting.appendleft(req)
            self._counts["preemptions"] += 1
        log.info("request %s preempted after %d tokens: the KV cache is full; it waits to be admitted again",
                 req.id, len(req.tokens))

    def run_until_done(self) -> None:
        """step() until no request is waiting or running."""
        while self.waiting or self.running:
            self.step()

    def _prefix_cache(self, cache: KVCache, tokens: int | None) -> PrefixCache | None:
        """The engine's prefix cache (None: off), the loop and the drafter told: a pool of its own
        beside per-row slots, or the blocks of a paged cache's own pool (`PagedPrefixCache`)."""
        paged = cache.block_table is not None
        if tokens is None and paged:
            tokens = cache.num_blocks * cache.block_size
        elif tokens is None:
            tokens = self.max_batch * self.max_len
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be an integer >= 0 (0: no prefix cache), got {tokens!r}")
        if tokens and tokens < DEFAULT_BLOCK:
            raise ValueError(f"prefix_cache_tokens holds whole blocks of {DEFAULT_BLOCK} positions: pass 0 (off) or "
                             f"at least {DEFAULT_BLOCK}, got {tokens}")
        if not tokens:
            return None
        if self.drafter is not None and self.drafter.hidden_layers:
            log.info("no prefix cache: drafter %r reads the target's states at every prompt position, so every "
                     "prompt is prefilled whole", self.drafter.name)
            return None
        if self.drafter is not None:
            self.drafter.cache_prefixes(min(tokens, self.max_batch * self.max_len))
        return PagedPrefixCache(cache, tokens) if paged else PrefixCache(cache, tokens)

    def _admit(self, admitted: list[Request], finished: list[Request]) -> None:
        """Give each request a free row and prefill them, one forward per run of consecutive rows
        (all rows at once when the engine starts); each emits its first token there. With a prefix
        cache, a request whose prompt starts with cached blocks, or with a full block of a prompt
        admitted before it in this step, is admitted alone after the others: its cached blocks are
        copied into its row and only the rest of its prompt is prefilled."""
        free = [b for b, r in enumerate(self.slots) if r is None][:len(admitted)]
        for b, req in zip(free, admitted):
            self.slots[b] = req
            self._admissions += 1
            self._admitted_at[b] = self._admissions
        for b in free:
            if self.slots[b].params.max_new_tokens == 0:
                self._retire(b, "length", finished)
        rows = [b for b in free if self.slots[b] is not None]
        alone: list[int] = []
        if self.prefixes is not None:
            block, seen = self.prefixes.block, []
            for b in rows:
                prompt = self.slots[b].sequence
                if self.prefixes.cached(prompt) or any(common_prefix(p, prompt) >= block for p in seen):
                    alone.append(b)
                else:  # a miss, looked up (and counted) here: nothing cached, nothing beside it to wait for
                    self.prefixes.get(prompt, self.loop.cache, b)
                seen.append(prompt)
        for run in runs([b for b in rows if b not in alone]):
            self._admit_run(run)
        for b in alone:
            self._admit_run([b], lookup=True)

    def _admit_run(self, run: list[int], lookup: bool = False) -> None:
        """Prefill the requests of `run` (consecutive rows) in one forward and deliver their first
        tokens. If that raises, the rows are released and each is admitted again alone, its
        generator rewound (its draws are those of an admission of its own): a request whose own
        admission raises ends with "error". lookup: the one row starts from the cached blocks its
        prompt begins with. The prompts' blocks go to the prefix cache once admitted."""
        reqs = [self.slots[b] for b in run]
        prompts = [r.sequence for r in reqs]  # a preempted request: its prompt and its tokens so far
        rewind = [None if r.generator is None else r.generator.get_state() for r in reqs]
        try:
            cached = self.prefixes.get(prompts[0], self.loop.cache, run[0]) if lookup else 0
            for b, prompt in zip(run, prompts):  # a paged cache's blocks for the prompts (admission made room)
                self.loop.cache.reserve(b, prompt.numel())
            first = self.loop.admit(run, prompts, [r.params.max_new_tokens - len(r.tokens) for r in reqs],
                                    [self.eos | frozenset(r.params.stop_token_ids) for r in reqs],
                                    [RowSampling(r.params, r.generator) for r in reqs], cached=cached)
            self._prefilled_tokens += sum(p.numel() for p in prompts) - cached
        except Exception as err:
            for b in run:
                self.loop.faults.pop(b, None)
            if len(run) == 1:
                self._fault(run[0], "admission", err)
                return
            for b, req, state in zip(run, reqs, rewind):
                try:
                    self.loop.release(b)
                except Exception as release_err:
                    self._fault(b, "release", release_err)
                    continue
                if state is not None:
                    req.generator.set_state(state)
                self._admit_run([b])
            return
        self._take_loop_faults()
        now = time.perf_counter()
        for b, req, prompt, new in zip(run, reqs, prompts, first):
            if b not in self._faults:
                if self.prefixes is not None:  # at once: a request arriving beside this one may share it
                    self.prefixes.put(prompt, self.loop.cache, b)
                self._deliver(req, b, new, now)

    def _deliver(self, req: Request, row: int, new: list[int], now: float) -> None:
        """Hand a step's tokens to the request and its listener (a listener that raises ends the request)."""
        if req.first_token_at is None:
            req.first_token_at, req.ttft_s = now, now - req.submitted_at
        req.tokens.extend(new)
        s, (tf, dr, ac) = self.loop.row_stats[row], req.stats_before
        req.target_forwards, req.drafted = tf + s.target_forwards, dr + s.drafted_tokens
        req.accepted = ac + s.accepted_tokens
        if req.on_tokens is not None:
            try:
                req.on_tokens(req, list(new))
            except Exception as err:
                self._fault(row, "listener", err)

    def _fault(self, row: int, stage: str, err: Exception) -> None:
        """Set `row`'s request aside: it decodes nothing more and ends with "error" (its first fault)
        at the end of this step."""
        if row in self._faults:
            return
        self._faults[row] = RequestError.of(stage, err)
        self.loop.state.free(row)
        _log_fault(self.slots[row].id, "ends with an error", self._faults[row], err)

    def _take_loop_faults(self) -> None:
        """The rows whose sampling raised in the loop's last call."""
        faults, self.loop.faults = self.loop.faults, {}
        for row, err in faults.items():
            self._fault(row, "sampling", err)

    def _fail_all(self, err: Exception) -> None:
        """The batch's step raised: every request in flight ends with "error", and every row's cache
        starts empty again (the failed forward may have left lengths that no rollback reset)."""
        rows = [b for b, r in enumerate(self.slots) if r is not None and b not in self._faults]
        log.error("a decode step failed (the target's forward or the drafter's propose / commit); the %d "
                  "requests in flight end with an error", len(rows), exc_info=err)
        for b in rows:
            self._faults[b] = RequestError.of("step", err)
            self.loop.state.free(b)
        self.loop.cache.lengths.zero_()

    def _retire(self, row: int, reason: str, finished: list[Request]) -> None:
        """Finish the request in `row` and free the row; a fault of the request (`_faults`), or of the
        drafter's release of its row, makes the reason "error" (a cancelled request stays cancelled)
        and zeroes the row's keys and values."""
        req = self.slots[row]
        self.slots[row] = None
        error = self._faults.pop(row, None)
        if self.prefixes is not None and error is None and req.first_token_at is not None:
            held = int(self.loop.cache.lengths[row])  # the prompt and the answer, but its last token
            self.prefixes.put(self.loop.state.sequences()[row][:held], self.loop.cache, row)
        if error is not None:
            # what a fault left in the row (NaN keys from NaN activations, say) would reach its next
            # request: the masked-out slots of a row get attention weight 0, and 0 x NaN is NaN
            self.loop.cache.free_row(row, zero=True)
        try:
            self.loop.release(row)
        except Exception as err:  # the row is free all the same: its cache length and state were reset first
            fault = RequestError.of("release", err)
            _log_fault(req.id, "could not release its row", fault, err)
            error = error or fault
            self.loop.cache.free_row(row, zero=True)
        if error is not None and reason != "cancelled":
            req.error, reason = error, "error"
        self._finish(req, reason, finished)

    def _finish(self, req: Request, reason: str, finished: list[Request]) -> None:
        """Mark `req` finished and, unless cancelled, tell its listener (outside the lock; an
        exception there is logged: the request has ended)."""
        req.finish_reason, req.finished_at = reason, time.perf_counter()
        n = len(req.tokens)
        if req.first_token_at is not None:
            req.tpot_s = (req.finished_at - req.first_token_at) / (n - 1) if n > 1 else 0.0
        with self._lock:
            self._live.pop(req.id, None)
            self._cancel.pop(req.id, None)  # a cancel that raced the finish must not hit a later request of this id
            self._counts["requests_finished"] += 1
            self._counts[f"finished_{reason}"] += 1
            if reason in ("stop", "length") and req.first_token_at is not None:
                self._ttft.append(req.ttft_s)
                self._tpot.append(req.tpot_s)
        finished.append(req)
        if reason != "cancelled" and req.on_tokens is not None:
            try:
                req.on_tokens(req, [])
            except Exception as err:  # already said if the listener is what ended the request
                again = req.error is not None and req.error.stage == "listener"
                _log_fault(req.id, f"(finish reason {reason!r}) raised on its listener's final call",
                           RequestError.of("listener", err), err, warn=not again)

    @property
    def metrics(self) -> dict:
        """Counters since the start: requests (total, finished, by finish reason), queue and rows,
        steps, and the acceptance figures of every row's verification steps (AcceptanceStats'
        conventions: tau = generated tokens per target forward, per row), and p50 / p95 TTFT and
        TPOT of the last requests that finished with "stop" or "length". `by_drafter`: per drafter (a
        composite's or hybrid's member) the steps that verified its proposals, their drafted and
        accepted tokens, acceptance rate and tau over those steps. The KV cache (`_cache_metrics`):
        kv_tokens_in_use / kv_tokens_capacity, kv_block_size and kv_blocks_total / used / free / cached
        (a paged cache's; zeros with per-row slots, but cached), preemptions, prefill_tokens, and
        prefix_cache_* (block, lookups, hits, looked_up_tokens, hit_tokens, evictions, num_blocks,
        blocks_cached, blocks_free)."""
        s: AcceptanceStats = self.loop.stats
        out = {}
        with self._lock:
            out.update(self._counts)
            recent = {"ttft_s": sorted(self._ttft), "tpot_s": sorted(self._tpot)}
        out.update(waiting=self.waiting, running=self.running, max_batch=self.max_batch,
                   generated_tokens=s.generated_tokens, target_forwards=s.target_forwards, drafted=s.drafted_tokens,
                   accepted=s.accepted_tokens, tau=s.mean_accepted_tokens, mean_accepted_tokens=s.mean_accepted_tokens,
                   acceptance_rate=s.acceptance_rate, per_position_acceptance=s.per_position_acceptance,
                   draft_s=s.draft_s, verify_s=s.verify_s)
        out.update(self._cache_metrics())
        out["by_drafter"] = {name: {"steps": d.target_forwards, "drafted": d.drafted_tokens,
                                    "accepted": d.accepted_tokens, "acceptance_rate": d.acceptance_rate,
                                    "tau": d.mean_accepted_tokens}
                             for name, d in sorted(self.loop.by_drafter.items())}
        for name, ordered in recent.items():
            for q in (50, 95):
                out[f"{name}_p{q}"] = ordered[min(len(ordered) - 1, q * len(ordered) // 100)] if ordered else 0.0
        return out


    def _cache_metrics(self) -> dict:
        """KV positions in use by running rows, prompt tokens prefilled, and the prefix cache's
        lookups, hits, tokens served from it, blocks and evictions (zeros when it is off)."""
        cache, p = self.loop.cache, self.prefixes
        running = [b for b, r in enumerate(self.slots) if r is not None]
        paged = cache.block_table is not None
        out = {"kv_tokens_in_use": int(cache.lengths[running].sum()) if running else 0,
               "kv_tokens_capacity": cache.num_blocks * cache.block_size if paged
               else cache.batch_size * cache.max_seq_len,
               "kv_block_size": cache.block_size if paged else 0,
               "kv_blocks_total": cache.num_blocks if paged else 0,
               "kv_blocks_used": cache.blocks_in_use if paged else 0,
               "kv_blocks_free": cache.blocks_free if paged else 0,
               "kv_blocks_cached": 0 if p is None else p.blocks_cached,
               "prefill_tokens": self._prefilled_tokens,
               "prefix_cache_block": 0 if p is None else p.block}
        for key in ("lookups", "hits", "looked_up_tokens", "hit_tokens", "evictions", "num_blocks",
                    "blocks_cached", "blocks_free"):
            out[f"prefix_cache_{key}"] = 0 if p is None else getattr(p, key)
        return out


def _log_fault(request_id: str, what: str, fault: RequestError, err: BaseException, warn: bool = True) -> None:
    """One warning line for a request's fault (its id, the stage, the exception's type and message;
    at debug level unless `warn`), and its traceback at debug level."""
    log.log(logging.WARNING if warn else logging.DEBUG, "request %s %s: %s", request_id, what, fault)
    log.debug("traceback of request %s's %s", request_id, type(err).__name__, exc_info=err)


class _IsolatingLoop(DecodeLoop):
    """The engine's DecodeLoop: a row whose sampling or verification raises (NaN logits, say) is set
    aside instead of failing the batch: its exception waits in `faults` (row -> exception) for the
    engine and the row emits nothing more. The other rows get the tokens the plain loop gives them:
    each row is sampled by the call it gets there (one row at a time; one verification per group of
    rows with equal settings, and a sampled row's group is that row alone, its generator being its
    own). A greedy group that raises is verified again row by row (greedy verification draws nothing,
    so a row's verdict is the same alone)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.faults: dict[int, Exception] = {}

    def _set_aside(self, row: int, err: Exception) -> None:
        self.faults.setdefault(row, err)
        self.state.free(row)

    def _select(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        out = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        for i, b in enumerate(rows):
            try:
                out[i] = super()._select(logits[i:i + 1], [b])[0]
            except Exception as err:  # this row's fault: the others keep their tokens
                self._set_aside(b, err)
        return out

    def _verify(self, logits: torch.Tensor, tree, valid: torch.Tensor, active: list[int]) -> Verdict:
        groups: dict[tuple, list[int]] = {}
        for b in active:
            groups.setdefault(self.sampling[b].key, []).append(b)
        paths: list[list[int]] = [[] for _ in range(tree.batch_size)]
        next_tokens = torch.zeros(tree.batch_size, dtype=torch.long)
        for key, rows in groups.items():
            try:
                parts = [(rows, super()._verify(logits, tree, valid, rows))]
            except Exception as err:
                if len(rows) == 1 or key != ("greedy",):
                    for b in rows:
                        self._set_aside(b, err)
                    continue
                parts = []
                for b in rows:
                    try:
                        parts.append(([b], super()._verify(logits, tree, valid, [b])))
                    except Exception as row_err:
                        self._set_aside(b, row_err)
            for done, part in parts:
                for b in done:
                    paths[b], next_tokens[b] = part.paths[b], part.next_tokens[b]
        return Verdict(paths, next_tokens)
