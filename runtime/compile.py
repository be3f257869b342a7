"""Compiled short forwards (decode steps, draft verification): `Transformer.compile_decode`.

Decoding runs thousands of forwards of 1..k+1 tokens; each is dozens of small ATen calls per
layer plus one matmul per weight. `torch.compile` (Inductor) turns that into one generated C++
program per shape that fuses the small ops and calls oneDNN for the linears. On a 2-core Xeon
with AMX (`spr-amx` in BENCHMARKS.md's machine table; figures in its section 2), compiled decoding
(then with frozen weights) runs qwen2.5-coder-1.5b-instruct bf16 at 6.9 tok/s instead of 5.0,
smollm2-135m-instruct bf16 at 44.8 instead of 28.7 and float32 at 34.6 instead of 29.3; the
measurements behind the design below are in docs/experiments/2026-11-21-compiled-decode-step.md.

`Transformer.compile_decode()` (or `runtime.compile_decode(model)`) stores the compiled
`Transformer.static_step` as `model.compiled_step`; `Transformer.forward` runs through it every
forward that fits, and eagerly otherwise. Both run the same layers.

How the program stays valid for every call: `static_step` has no host syncs, and each layer's
cache write + attention is one opaque in-place custom op (`runtime.attention.cache_attention`),
so the cache length is a dynamic dimension and prompts of any length share one program. Which
forwards take a program (`Transformer._static_fits`), and at which size:

- a causal forward of up to MAX_STATIC_TOKENS (32) tokens, padded by `static_tokens` to 1, 8, 16
  or 32 (extra query rows write past the row's length, where nothing reads them before they are
  overwritten; with no room left in the cache for the padding, it runs at its own size);
- one with selected logits (`logits_idx`: a prompt's prefill, a draft's feeds) of up to
  DECODE_STATIC_TOKENS (8) tokens, padded to 1 or 8 and its logits gathered from the program's
  output; a 2-token feed after the prompt (a draft's catch-up) has a 2-token program of its own.
  Longer ones (a prompt of more than 8 tokens) run eagerly rather than compile a 16- or 32-token
  program (a minute-long compile per shape);
- a tree step, with a `block_mask` (B, N, N) (which tree tokens each one sees) and no selected
  logits, of up to MAX_BLOCK_TOKENS (256) tokens, unless a sliding window cuts into a row: up to
  DECODE_STATIC_TOKENS padded as a causal step (a suffix match's tree changes size every step;
  a padding token sees only itself), larger ones (Medusa's, EAGLE's trees keep their size for a
  whole generation) at their own size N. These larger programs call their kernels from a Python
  wrapper, the others from C++ (`cpp_wrapper`): on 2 cores Inductor builds smollm2's C++ wrapper
  in ~4 minutes per program against ~40 s, and it saves ~4 ms of a 1-token step.

Everything else runs eagerly: a forward without a cache, one with a full (B, T, S) `mask`, a
causal forward of more than 32 tokens (more than 8 with selected logits), a tree step of more
than 256 tokens or one that a sliding window cuts. So one generation with k <= 7 draft tokens
compiles every program it needs (1 and 8 tokens, 2 for a draft's feeds, a tree's size) in its
first steps, and a warm-up run is enough. Every program returns a `ModelOutput` with the final
hidden states (`return_hidden`: Medusa heads, self-distillation data); the states entering
`aux_layers` (EAGLE-3) are an argument the compiler specializes on, one program per tuple.

Weights: by default every program reads the model's own weight tensors, so all block and batch
sizes share one copy (memory: benchmarks/compiled_memory.py, BENCHMARKS.md section 7).
`freeze_weights=True` has Inductor fold them into each program as prepacked constants instead: a
full copy per program, for no measured step-time gain on an AVX-512-BF16 CPU; on an AMX CPU the
prepacked path may be faster (docs/experiments/2026-11-21-compiled-decode-step.md), so compare
there before choosing.
Use a compiled model for inference only (`torch.inference_mode`, as `specdec.generate` runs). The
first call of each shape compiles (about a minute for a 1.5B model on 2 cores; Inductor's cache
makes later processes faster); later calls reuse it.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

from runtime.model_output import ModelOutput

MAX_STATIC_TOKENS = 32  # causal forwards of up to this many tokens take the compiled path
MAX_BLOCK_TOKENS = 256  # block-mask (tree) forwards of up to this many tokens take it, unpadded
# forwards with selected logits (a prefill, a draft's feeds) of up to this many tokens take the compiled
# path; the largest program plain and speculative decoding (k <= 7) compile
DECODE_STATIC_TOKENS = 8
_RECOMPILE_LIMIT = 64  # (model, batch, tokens, cache) shapes one process may compile

NOTICE_AFTER_S = 5.0  # a first call of a shape that runs longer than this says that it is compiling

# static_step(tokens, positions, k, v, lengths, block_mask=None, aux_layers=()) -> ModelOutput(logits (B, T, V),
# hidden (B, T, C), aux (B, T, len(aux_layers) * C) or None)
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


def uses_cpp_wrapper(num_tokens: int, cpp_wrapper: bool = True) -> bool:
    """Whether the program of a `num_tokens`-token step calls its kernels from C++: only with
    `cpp_wrapper` and up to DECODE_STATIC_TOKENS tokens. A larger (Medusa / EAGLE tree) program gets
    the Python wrapper: Inductor builds the C++ one ~6x slower (minutes per tree size on 2 cores) to
    save a few ms a call (benchmarks/compile_wrapper.py, BENCHMARKS.md section 7)."""
    return cpp_wrapper and num_tokens <= DECODE_STATIC_TOKENS


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


def compile_step(step: Step, device: torch.device, cpp_wrapper: bool = True,
                 max_autotune: bool | None = None, freeze_weights: bool = False,
                 eager_rounding: Callable[[], bool] = lambda: False) -> Step:
    """`torch.compile` a model's `static_step` (on `device`): the function that
    `Transformer.compile_decode` stores as `compiled_step`. Options as `compile_decode` (cpp_wrapper
    applies to the programs of up to DECODE_STATIC_TOKENS tokens; larger ones call their kernels from Python);
    eager_rounding() says, per call, whether programs compiled then round every bf16 intermediate
    as eager does (the model's `row_invariant`, on which the compiler also guards)."""
    cxx = torch._inductor.config.cpp.cxx  # what Inductor's CPU backend invokes ($CXX when torch loaded)
    candidates = [c for c in (cxx if isinstance(cxx, tuple) else (cxx,)) if c]
    if torch.device(device).type == "cpu" and not any(shutil.which(c) for c in candidates):
        raise RuntimeError(f"compiling for the CPU needs a C++ compiler, and none of {candidates} is on "
                           "PATH: install g++ (or set CXX before starting Python), or run without compile")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    compiled = torch.compile(step)
    autotune = {} if max_autotune is None else {"max_autotune": max_autotune}
    notices = CompileNotices()

    def compiled_step(tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      lengths: torch.Tensor, block_mask: torch.Tensor | None = None,
                      aux_layers: tuple[int, ...] = ()) -> ModelOutput:
        # the cache length is the one dynamic dimension: prompts of any length share a program
        torch._dynamo.mark_dynamic(k, 3)
        torch._dynamo.mark_dynamic(v, 3)
        # freezing set through torch.compile(options=...) does not reach Inductor's freezing pass
        # (the step is no faster), so the config is patched around each call instead.
        # emulate_precision_casts: round every bf16 intermediate as eager does; otherwise whether a
        # fused value is rounded depends on the fusion, which differs between block sizes, and a
        # row's logits would depend on the program (`runtime.invariant`)
        with torch._inductor.config.patch(freezing=freeze_weights,
                                          cpp_wrapper=uses_cpp_wrapper(tokens.shape[1], cpp_wrapper),
                                          emulate_precision_casts=eager_rounding(), **autotune), \
                torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            B, T = tokens.shape
            key = (B, T, block_mask is not None, aux_layers, k.dtype, eager_rounding())
            what = f"the {T}-token {'tree ' if block_mask is not None else ''}step of a batch of {B}"
            return notices.run(key, what, lambda: compiled(tokens, positions, k, v, lengths, block_mask, aux_layers))

    return compiled_step


def compile_decode(model: torch.nn.Module, cpp_wrapper: bool = True,
                   max_autotune: bool | None = None, freeze_weights: bool = False) -> torch.nn.Module:
    """Compile `model`'s short forwards in place and return the model: `model.compile_decode(...)`.

    model: a runtime Transformer (also a compressed one); anything else is a TypeError.
    cpp_wrapper, max_autotune, freeze_weights: see `Transformer.compile_decode`.
    """
    from runtime.model import Transformer

    if not isinstance(model, Transformer):
        raise TypeError(f"compile_decode takes a runtime Transformer (runtime.load_model), got "
                        f"{type(model).__name__}")
    return model.compile_decode(cpp_wrapper=cpp_wrapper, max_autotune=max_autotune, freeze_weights=freeze_weights)
