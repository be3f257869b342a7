"""Compiled short forwards (decode steps, draft verification): `Transformer.compile_decode`.

Decoding runs thousands of forwards of 1..k+1 tokens; each is dozens of small ATen calls per
layer plus one matmul per weight. `torch.compile` (Inductor) turns each decoder layer into one
generated C++ program per shape that fuses the small ops around the linears.

Programs are regional: one program per (layer kind, shape) runs every layer of that kind, one
runs the embedding and the rope's gathers, and one more runs the final norm and the LM head. A
layer kind is what the compiler specializes on: the layer's module types, their attributes and
their tensors' shapes and dtypes (a Q4_K_M GGUF mixes Q4_K and Q6_K layers: two kinds). So a
new shape compiles one or two layers, not the whole unrolled model, and all layers share the same
generated code. Each program is built once with `torch.compile(...).aot_compile` and then called
without Dynamo's per-call guard evaluation: `Regions` keys it by the kind and the input shapes,
and checks the compiler's guards once for every layer that first uses it (a layer that fails them
gets its own program).
Later calls skip Dynamo's and AOTAutograd's wrappers too where that is shown to change nothing
(`_Direct`): they hand Inductor's generated code its flat inputs themselves.

`Transformer.compile_decode()` (or `runtime.compile_decode(model)`) stores the compiled step as
`model.compiled_step`; `Transformer.forward` runs through it every forward that fits, and
eagerly otherwise. Both run the same layers.

How a program stays valid for every call: the step has no host syncs, and each layer's cache
write + attention is one opaque in-place custom op (`runtime.attention.cache_attention`) over
that layer's cache buffers, whose length is a dynamic dimension, so prompts of any length share
a program. Which forwards take a program (`Transformer._static_fits`), and at which size:

- a causal forward of up to MAX_STATIC_TOKENS (32) tokens, padded by `static_tokens` (extra
  query rows write past the row's length, where nothing reads them before they are
  overwritten; with no room left in the cache for the padding, it runs at its own size);
- one with selected logits (`logits_idx`: a prompt's prefill, a draft's feeds) of up to
  DECODE_STATIC_TOKENS (8) tokens, padded the same way, its logits gathered from the output.
  Longer ones (a prompt of more than 8 tokens) run eagerly;
- a tree step, with a `block_mask` (B, N, N) (which tree tokens each one sees) and no selected
  logits, of up to MAX_BLOCK_TOKENS (256) tokens, unless a sliding window cuts into a row: up to
  DECODE_STATIC_TOKENS padded as a causal step (a suffix match's tree changes size every step;
  a padding token sees only itself), larger ones (Medusa's, EAGLE's trees keep their size for a
  whole generation) at their own size N.

Everything else runs eagerly: a forward without a cache, one with a full (B, T, S) `mask`, a
causal forward of more than 32 tokens (more than 8 with selected logits), a tree step of more
than 256 tokens or one that a sliding window cuts. Every program returns the final hidden
states (`return_hidden`: Medusa heads, self-distillation data); the states entering
`aux_layers` (EAGLE-3) are gathered between the layer programs.

Programs read the model's own weight tensors, so every shape shares one copy. Compile after the
model's modules and weights are final (`compile_decode` again after replacing a layer's
modules). Use a compiled model for inference only (`torch.inference_mode`, as
`specdec.generate` runs). Inductor's cache keeps the generated code for later processes.
"""

from __future__ import annotations

import contextlib
import operator
import shutil
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

import torch
from torch._inductor.output_code import CompiledFxGraph

from runtime.model_output import ModelOutput

MAX_STATIC_TOKENS = 32  # causal forwards of up to this many tokens take the compiled path
MAX_BLOCK_TOKENS = 256  # block-mask (tree) forwards of up to this many tokens take it, unpadded
# forwards with selected logits (a prefill, a draft's feeds) of up to this many tokens take the compiled
# path; the largest program plain and speculative decoding (k <= 7) compile
DECODE_STATIC_TOKENS = 8

NOTICE_AFTER_S = 5.0  # a first call of a shape that runs longer than this says that it is compiling

# static_step(tokens, positions, k, v, lengths, block_mask=None, aux_layers=(), regions=None) -> ModelOutput(
# logits (B, T, V), hidden (B, T, C), aux (B, T, len(aux_layers) * C) or None)
Step = Callable[..., ModelOutput]


def static_tokens(num_tokens: int, selected: bool = False, row_cost: bool = False) -> int:
    """The padded number of tokens a compiled forward of `num_tokens` runs with: 1, or a power of
    two >= 8 (a verification block of 2..8 tokens costs about the same as one of 8 on a bf16
    model on a CPU, and fewer shapes mean fewer minute-long compiles).

    selected: the caller keeps only some positions' logits after the prompt (`logits_idx` on a
    filled cache: a draft's feeds). Then 2 tokens get their own program: a draft feeds 2 tokens
    (its last draft and the target's bonus token) after every fully accepted block, and on a
    quantized draft, whose packed kernels cost per row, padding that call to 8 costs about twice
    as much (docs/experiments/2026-11-22-quantized-drafts.md).
    row_cost: the model's linears cost per row (GGUF block weights: `runtime.blockq`, whose extra rows
    are cheap up to 4 and cost arithmetic beyond), so every power of two gets its own program (2, 4, 8, ...).
    """
    if num_tokens <= 1:
        return 1
    if (selected or row_cost) and num_tokens == 2:
        return 2
    if row_cost and num_tokens <= 4:
        return 4
    return max(8, 1 << (num_tokens - 1).bit_length())


R = TypeVar("R")


class CompileNotices:
    """Progress lines for compiled programs: the first call of each program key that runs longer than
    `after_s` prints "compiling ..." on stderr when it passes `after_s` and "compiled ... in N s" when it
    returns; a program Inductor's cache already holds returns first and prints nothing."""

    def __init__(self, after_s: float = NOTICE_AFTER_S) -> None:
        self.after_s = after_s
        self.seen: set[Hashable] = set()

    def run(self, key: Hashable, what: str, call: Callable[[], R]) -> R:
        """call(); on the first call of `key`, with the notices above (`what` names the program)."""
        if key in self.seen:
            return call()
        start = time.monotonic()
        told = threading.Event()

        def tell() -> None:
            told.set()
            print(f"compiling {what} (once per shape; Inductor's cache keeps it for later runs)...", file=sys.stderr,
                  flush=True)

        timer = threading.Timer(self.after_s, tell)
        timer.daemon = True
        timer.start()
        try:
            out = call()
        finally:
            timer.cancel()
        self.seen.add(key)
        if told.is_set():
            print(f"compiled {what} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        return out


def module_kind(module: torch.nn.Module) -> tuple:
    """What a compiled program specializes on in `module`: for it and every submodule, the type and
    the plain (int, float, str, bool, None) attributes, and each parameter's and buffer's shape, dtype
    and strides. Two modules of one kind run one program."""
    kind = []
    for name, sub in module.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items()
                             if not k.startswith("_") and (v is None or isinstance(v, (int, float, str, bool)))))
        tensors = tuple((k, None if t is None else (tuple(t.shape), t.dtype, t.stride(), t.device.type))
                        for k, t in [*sub._parameters.items(), *sub._buffers.items()])
        kind.append((name, type(sub).__qualname__, attrs, tensors))
    return tuple(kind)


class Regions:
    """The compiled programs of a model's regions (a decoder layer, the head), built ahead of time and
    called without Dynamo's per-call guards.

    `run(fn, owner, modules, *args)` calls `fn(*modules, *args)` through the program for (fn, the
    modules' kinds, the arguments' shapes and dtypes, the grad mode, eager_rounding()). The first call of each
    owner (a layer index) on a program checks that program's guards against the real arguments; an
    owner that fails them gets a program of its own. Later calls find the program by (`step`, fn,
    owner, the modules' identities), where `step` is the caller's key of what fixes every argument's
    shape (set per step by `compile_step`), so a call costs a dictionary lookup. `dynamic` maps a
    region function to its (argument index, dim) pairs that vary freely (the cache length); indices
    count the arguments after the modules. cpp_wrapper, max_autotune and eager_rounding() are Inductor
    options of every program built; with eager_rounding(), `reduction_size` (the longest reduction of a
    row in a program: the norms' hidden size) sets Inductor's `cpp.min_chunk_size` so that no kernel
    splits a row's reduction across threads (see `_options`). direct: bind each call without grad to
    its program's Inductor graph (`_bind`), which saves ~11 us a call; False keeps every call on
    the program.
    """

    def __init__(self, cpp_wrapper: bool = True, max_autotune: bool | None = None,
                 eager_rounding: Callable[[], bool] = lambda: False,
                 dynamic: dict[Callable, tuple[tuple[int, int], ...]] | None = None,
                 reduction_size: int = 0, direct: bool = True) -> None:
        self.cpp_wrapper, self.max_autotune, self.eager_rounding = cpp_wrapper, max_autotune, eager_rounding
        self.reduction_size, self.direct = reduction_size, direct
        self.dynamic = dynamic or {}
        self.step: Hashable = None
        self._compiled: dict[Callable, Callable] = {}  # fn -> torch.compile(fn, fullgraph=True)
        self._programs: dict[Hashable, Callable] = {}  # key -> AOT-compiled program
        self._calls: dict[Hashable, Callable] = {}  # (step, fn, owner, id(module)) -> its program or _Direct

    @property
    def programs(self) -> int:
        """How many programs were built."""
        return len(self._programs)

    @property
    def direct_calls(self) -> int:
        """How many call sites (step, region, owner) run their program's Inductor graph directly."""
        return sum(isinstance(c, _Direct) for c in self._calls.values())

    def run(self, fn: Callable, owner: Hashable, modules: tuple[torch.nn.Module, ...], *args: object) -> object:
        """fn(*modules, *args) through its compiled program (built on first use)."""
        call = (self.step, fn, owner, *map(id, modules))
        program = self._calls.get(call)
        if program is None:
            program = self._program(fn, owner, modules, args)
            if not self.direct or torch.is_grad_enabled():
                self._calls[call] = program
            else:
                self._calls[call], out = _bind(program, modules, args, self.cpp_wrapper)
                return out
        return program(*modules, *args)

    def _program(self, fn: Callable, owner: Hashable, modules: tuple[torch.nn.Module, ...], args: tuple) -> Callable:
        dims: dict[int, set[int]] = {}
        for index, dim in self.dynamic.get(fn, ()):
            dims.setdefault(index, set()).add(dim)
        shapes = tuple((tuple(-1 if d in dims.get(i, ()) else n for d, n in enumerate(a.shape)), a.dtype,
                        a.device.type) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
        key = (fn, tuple(map(module_kind, modules)), shapes, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
               self.eager_rounding())
        if key in self._programs and not self._programs[key].guard_check(*modules, *args):
            key = (key, owner)  # the program specializes on something this owner differs in
        if key not in self._programs:
            compiled = self._compiled.get(fn)
            if compiled is None:
                compiled = self._compiled[fn] = torch.compile(fn, fullgraph=True)
            for index, dim in self.dynamic.get(fn, ()):
                torch._dynamo.mark_dynamic(args[index], dim)
            # emulate_precision_casts: round every bf16 intermediate as eager does; otherwise whether a
            # fused value is rounded depends on the fusion, which differs between shapes, and a row's
            # logits would depend on the program (`runtime.invariant`)
            # floats (a norm's eps, a block format's zero point) stay constants: a traced float makes
            # Dynamo restart its analysis, which an ahead-of-time build cannot do
            options = self._options()
            with torch._inductor.config.patch(**options), \
                    torch._dynamo.config.patch(specialize_float=True, automatic_dynamic_shapes=False):
                try:
                    program = compiled.aot_compile(((*modules, *args), {}))
                    program.disable_guard_check()
                except torch._dynamo.exc.TorchDynamoException:  # a graph break (a module Dynamo cannot trace whole)
                    program = _Guarded(fn, options)
            self._programs[key] = program
        return self._programs[key]

    def _options(self) -> dict:
        """Inductor's options for every program built."""
        autotune = {} if self.max_autotune is None else {"max_autotune": self.max_autotune}
        # row-invariant: no kernel may split a row's reduction across threads (Inductor parallelizes the
        # reduction loop when a kernel's rows are fewer than the threads and each thread would still get
        # min_chunk_size elements, e.g. a 1-token step's norms), which would sum the row in another order
        # than programs of more rows do. With min_chunk_size >= the reduction's length no thread's share of
        # it is long enough, while kernels of several rows still run their rows in parallel (a larger value
        # measured 2-4% slower at 8-16 rows on 2 cores)
        chunk = max(self.reduction_size, torch._inductor.config.cpp.min_chunk_size)
        invariant = {"cpp.min_chunk_size": chunk} if self.eager_rounding() else {}
        return {"cpp_wrapper": self.cpp_wrapper, "emulate_precision_casts": self.eager_rounding(), **autotune,
                **invariant}


class _Direct:
    """A program's Inductor graph called with its flat inputs, gathered from a call's modules and
    arguments by `sources` (one getter each), and its outputs put back in the region's structure
    (`outputs`: an index into the graph's outputs, or a tuple of them). This skips Dynamo's bytecode,
    AOTAutograd's runtime wrappers (five DisableContext levels among them) and a 0-d tensor made per
    integer input: ~11 us a call, ~0.3 ms of a 1-token step of the 4-bit 1.5B (29 calls)."""

    def __init__(self, graph: Callable[[list], list], sources: list[Callable[[tuple], object]],
                 outputs: int | tuple[int, ...]) -> None:
        self.graph, self.sources, self.outputs = graph, sources, outputs
        self._ints: dict[int, torch.Tensor] = {}  # value -> 0-d int64 tensor (`as_tensor`)

    def as_tensor(self, n: int) -> torch.Tensor:
        """n as the 0-d int64 tensor a C++-wrapper graph reads an integer input from: kept per value
        (a cache length, a layer's offset), where the graph would make one per call (~2 us each)."""
        t = self._ints.get(n)
        if t is None:
            if len(self._ints) >= 256:  # a long-running server meets many cache lengths
                self._ints.clear()
            t = self._ints[n] = torch.tensor(n, dtype=torch.int64)
        return t

    @classmethod
    def build(cls, graph: CompiledFxGraph, inputs: list, outputs: list, values: tuple, result: object,
              ints_as_tensors: bool = False) -> _Direct | None:
        """From one call of a program: `values` (its modules and arguments), the flat `inputs` and
        `outputs` its graph saw, its `result`. None where an input is not found: a tensor that is neither
        an argument nor a parameter or buffer of the modules, an integer that is not one size, stride
        or storage offset of the argument that follows it, a result leaf not among the outputs.
        ints_as_tensors: the graph has a C++ wrapper, which takes integers as 0-d tensors."""
        held: dict[int, Callable[[tuple], object]] = {}  # id(tensor) -> getter from its module's own dict
        for value in values:
            if isinstance(value, torch.nn.Module):
                for sub in value.modules():
                    for store in (sub._parameters, sub._buffers):
                        for name, t in store.items():
                            # read per call, as the program does: a tensor reassigned after compiling is seen
                            held.setdefault(id(t), lambda _, store=store, name=name: store[name])
        at = {id(v): i for i, v in reversed(list(enumerate(values))) if isinstance(v, torch.Tensor)}
        sources: list[Callable[[tuple], object]] = []
        ints: list[int] = []  # the positions of integer inputs
        for j, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                if id(x) in at:
                    sources.append(operator.itemgetter(at[id(x)]))
                elif id(x) in held:
                    sources.append(held[id(x)])
                else:
                    return None
            elif type(x) is int:  # a dynamic size, stride or offset, lifted before the tensor it belongs to
                owner = next((y for y in inputs[j + 1:] if isinstance(y, torch.Tensor)), None)
                if owner is None or id(owner) not in at:
                    return None
                i = at[id(owner)]
                found = [(lambda v, i=i, d=d: v[i].shape[d]) for d, n in enumerate(owner.shape) if n == x]
                found += [(lambda v, i=i, d=d: v[i].stride(d)) for d, n in enumerate(owner.stride()) if n == x]
                if owner.storage_offset() == x:
                    found.append(lambda v, i=i: v[i].storage_offset())
                if len(found) != 1:
                    return None
                sources.append(found[0])
                ints.append(j)
            else:
                return None
        index = {id(t): j for j, t in enumerate(outputs)}
        leaves = result if isinstance(result, tuple) else (result,)
        if not all(isinstance(t, torch.Tensor) and id(t) in index for t in leaves):
            return None
        where = tuple(index[id(t)] for t in leaves)
        direct = cls(graph.current_callable, sources, where if isinstance(result, tuple) else where[0])
        if ints_as_tensors:
            for j in ints:
                sources[j] = lambda v, get=sources[j]: direct.as_tensor(get(v))
        return direct

    def __call__(self, *values: object) -> object:
        out = self.graph([get(values) for get in self.sources])  # the graph clears the list it is given
        if isinstance(self.outputs, int):
            return out[self.outputs]
        return tuple(out[j] for j in self.outputs)


_PROBING = threading.RLock()  # one thread's probes at a time patch CompiledFxGraph.__call__ (nested: in order)


@contextlib.contextmanager
def _graph_calls() -> Iterator[list[tuple[CompiledFxGraph, list, list]]]:
    """Records (graph, flat inputs, outputs) of every Inductor graph this thread calls inside the block."""
    calls: list[tuple[CompiledFxGraph, list, list]] = []
    original, me = CompiledFxGraph.__call__, threading.get_ident()

    def record(graph: CompiledFxGraph, inputs: list) -> list:
        if threading.get_ident() != me:
            return original(graph, inputs)
        flat = list(inputs)  # the generated code clears `inputs`
        out = original(graph, inputs)
        calls.append((graph, flat, out))
        return out

    with _PROBING:
        CompiledFxGraph.__call__ = record
        try:
            yield calls
        finally:
            CompiledFxGraph.__call__ = original


def _same(a: object, b: object) -> bool:
    """Bit for bit (NaN included) equal tensors, or tuples of them."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _bind(program: Callable, modules: tuple[torch.nn.Module, ...], args: tuple,
          cpp_wrapper: bool) -> tuple[Callable, object]:
    """Run program(*modules, *args) -> (what this call site runs from now on, the result).

    The program's one Inductor graph called directly (`_Direct`) where that is shown to do what the
    program does: the call runs through the program while its graph's inputs and outputs are recorded,
    then again directly from the arguments' state before it, and both results and the arguments'
    states after (caches written in place) must be equal bit for bit. Otherwise, or for a region
    with a graph break, the program. cpp_wrapper: the programs were built with Inductor's C++ wrapper."""
    values = (*modules, *args)
    # arguments a call may write (a broadcast view, such as expanded positions, cannot be written in place)
    tensors = [a for a in args if isinstance(a, torch.Tensor)
               and not any(stride == 0 and size > 1 for size, stride in zip(a.shape, a.stride()))]
    before = [t.clone() for t in tensors]
    with _graph_calls() as calls:
        result = program(*values)
    direct = _Direct.build(*calls[0], values, result, cpp_wrapper) if len(calls) == 1 else None
    if direct is None:
        return program, result
    after = [t.clone() for t in tensors]
    for t, b in zip(tensors, before):
        t.copy_(b)
    again = direct(*values)
    if _same(again, result) and all(map(_same, tensors, after)):
        return direct, again
    for t, a in zip(tensors, after):
        t.copy_(a)
    return program, result


class _Guarded:
    """A region that Dynamo cannot compile as one graph: `torch.compile` with its graph breaks, whose
    guards Dynamo checks on every call (so `guard_check` has nothing to add)."""

    def __init__(self, fn: Callable, options: dict) -> None:
        self.compiled, self.options = torch.compile(fn), options

    def guard_check(self, *args: object) -> bool:
        return True

    def __call__(self, *args: object) -> object:
        with torch._inductor.config.patch(**self.options), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            return self.compiled(*args)


def compile_step(step: Step, device: torch.device, cpp_wrapper: bool = True,
                 max_autotune: bool | None = None, eager_rounding: Callable[[], bool] = lambda: False,
                 dynamic: dict[Callable, tuple[tuple[int, int], ...]] | None = None,
                 reduction_size: int = 0) -> Step:
    """A compiled `static_step` (on `device`): the function that `Transformer.compile_decode` stores as
    `compiled_step`. It runs `step(..., regions=Regions(...))`, which sends each region through its
    program. cpp_wrapper: Inductor calls each program's kernels from C++ rather than Python;
    max_autotune: Inductor's option (None leaves it alone); eager_rounding() says, per call, whether
    programs round every bf16 intermediate as eager does (the model's `row_invariant`); dynamic: the
    region functions' dimensions that vary freely; reduction_size: a row's longest reduction (`Regions`)."""
    cxx = torch._inductor.config.cpp.cxx  # what Inductor's CPU backend invokes ($CXX when torch loaded)
    candidates = [c for c in (cxx if isinstance(cxx, tuple) else (cxx,)) if c]
    if torch.device(device).type == "cpu" and not any(shutil.which(c) for c in candidates):
        raise RuntimeError(f"compiling for the CPU needs a C++ compiler, and none of {candidates} is on "
                           "PATH: install g++ (or set CXX before starting Python), or run without compile")
    regions = Regions(cpp_wrapper, max_autotune, eager_rounding, dynamic=dynamic, reduction_size=reduction_size)
    notices = CompileNotices()

    def compiled_step(tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      lengths: torch.Tensor, block_mask: torch.Tensor | None = None,
                      aux_layers: tuple[int, ...] = (), block_table: torch.Tensor | None = None) -> ModelOutput:
        B, T = tokens.shape
        if block_mask is not None:  # a program asserts its inputs' strides: an expanded mask has others
            block_mask = block_mask.contiguous()
        paged = None if block_table is None else (tuple(block_table.shape), tuple(k.shape))
        key = (B, T, block_mask is not None, k.dtype, eager_rounding(), paged)
        what = f"the {T}-token {'tree ' if block_mask is not None else ''}step of a batch of {B}"
        # what fixes every region argument's shape but the cache length (the model fixes the rest)
        regions.step = (key, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), k.device)
        return notices.run(key, what, lambda: step(tokens, positions, k, v, lengths, block_mask, aux_layers,
                                                   regions=regions, block_table=block_table))

    compiled_step.regions = regions  # type: ignore[attr-defined]
    return compiled_step


def compile_decode(model: torch.nn.Module, cpp_wrapper: bool = True,
                   max_autotune: bool | None = None) -> torch.nn.Module:
    """Compile `model`'s short forwards in place and return the model: `model.compile_decode(...)`.

    model: a runtime Transformer (also a compressed one); anything else is a TypeError.
    cpp_wrapper, max_autotune: see `Transformer.compile_decode`.
    """
    from runtime.model import Transformer  # runtime.model imports this module

    if not isinstance(model, Transformer):
        raise TypeError(f"compile_decode takes a runtime Transformer (runtime.load_model), got "
                        f"{type(model).__name__}")
    return model.compile_decode(cpp_wrapper=cpp_wrapper, max_autotune=max_autotune)
