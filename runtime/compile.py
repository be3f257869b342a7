"""`compile_decode`: torch.compile the short forwards (decode steps, draft verification) of a model.

Decoding runs thousands of forwards of 1..k+1 tokens; each is dozens of small ATen calls per
layer plus one matmul per weight. `torch.compile` with Inductor's weight freezing turns that into
one generated C++ program per shape whose linears use oneDNN with prepacked weights (AMX on CPUs
that have it). Measured on this repository's 2-core CPU (BENCHMARKS.md, `specdec bench
--compile`): a qwen2.5-coder-1.5b-instruct bf16 step 200 -> 145 ms, smollm2 bf16 35 -> 23 ms,
smollm2 float32 33 -> 28 ms.

How the program stays valid for every call: `Transformer.static_step` has no host syncs, and
each layer's cache write + attention is one opaque in-place custom op
(`runtime.attention.cache_attention`), so the cache length is a dynamic dimension and prompts of
any length share one program. The number of new tokens is padded to 1, 8, 16 or 32 (extra query
rows write past the row's length, where nothing reads them before they are overwritten), so one
generation with k <= 7 draft tokens compiles every program it needs (a warm-up run is enough);
each program holds its own frozen copy of the weights. Selected logits (`logits_idx`: a draft's
feeds, a prefill) of up to 8 tokens are gathered from the output of those same programs (a
draft's 2-token feed: a program of its own, see `static_tokens`); longer ones run eagerly
rather than compile a 16- or 32-token program with another weight copy. Every program also
returns the final hidden states (`return_hidden`: Medusa heads, self-distillation data). A
Medusa tree step passes a `block_mask` (B, N, N) (which tree tokens each one sees) and runs
compiled at its own size N <= MAX_BLOCK_TOKENS, unpadded (a tree keeps its size for a whole
generation; its program is one more weight copy). A forward with a full (B, T, S) mask, a
causal forward of more than 32 tokens, or a tree step that a sliding window cuts runs eagerly.

Freezing treats the weights as constants: compile after the weights are final, and use the model
for inference only (`torch.inference_mode`, as `specdec.generate` runs). The first call of each
shape compiles (about a minute for a 1.5B model on 2 cores); later calls reuse it.
"""

from __future__ import annotations

import shutil

import torch

MAX_STATIC_TOKENS = 32  # causal forwards of up to this many tokens take the compiled path
MAX_BLOCK_TOKENS = 256  # block-mask (tree) forwards of up to this many tokens take it, unpadded
DECODE_STATIC_TOKENS = 8  # the largest program plain and speculative decoding (k <= 7) compile
_RECOMPILE_LIMIT = 64  # (model, batch, tokens, cache) shapes one process may compile


def static_tokens(num_tokens: int, selected: bool = False) -> int:
    """The padded number of tokens a compiled forward of `num_tokens` runs with: 1, or a power of
    two >= 8 (a verification block of 2..8 tokens costs about the same as one of 8 on a bf16
    model on a CPU, and fewer shapes mean fewer minute-long compiles).

    selected: the caller keeps only some positions' logits after the prompt (`logits_idx` on a
    filled cache: a draft's feeds). Then 2 tokens get their own program: a draft feeds 2 tokens
    (its last draft and the target's bonus token) after every fully accepted block, and on the
    INT4 0.5B draft, whose packed kernels cost per row, that call takes 31 ms against 66 ms
    padded to 8 (1 token: 26 ms).
    """
    if num_tokens <= 1:
        return 1
    if selected and num_tokens == 2:
        return 2
    return max(8, 1 << (num_tokens - 1).bit_length())


def compile_decode(model: torch.nn.Module, cpp_wrapper: bool = True,
                   max_autotune: bool | None = None) -> torch.nn.Module:
    """Compile `model`'s short forwards in place (returns the model).

    model: a runtime Transformer (also a compressed one). cpp_wrapper: let Inductor call the
    kernels from C++ rather than Python (saves ~1 ms per step on a small model).
    max_autotune: True lets Inductor also generate its own GEMM kernels (CPU: the CPP GEMM
    template, which covers the packed INT8 / INT4 weight-only matmuls) and keep the fastest per
    shape, compiling several times longer; None leaves Inductor's setting alone. Outputs equal
    the eager model's up to floating-point reassociation (float32: ~1e-6 relative; bf16: bf16
    rounding), so greedy tokens can differ from the eager model's only at near-ties.
    """
    from runtime.model import Transformer

    if not isinstance(model, Transformer):
        raise TypeError(f"compile_decode takes a runtime Transformer (runtime.load_model), got "
                        f"{type(model).__name__}")
    cxx = torch._inductor.config.cpp.cxx  # what Inductor's CPU backend invokes ($CXX when torch loaded)
    candidates = [c for c in (cxx if isinstance(cxx, tuple) else (cxx,)) if c]
    if model.device.type == "cpu" and not any(shutil.which(c) for c in candidates):
        raise RuntimeError(f"compiling for the CPU needs a C++ compiler, and none of {candidates} is on "
                           "PATH: install g++ (or set CXX before starting Python), or run without compile")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    compiled = torch.compile(model.static_step)
    autotune = {} if max_autotune is None else {"max_autotune": max_autotune}

    def step(tokens, positions, k, v, lengths, block_mask=None):
        # the cache length is the one dynamic dimension: prompts of any length share a program
        torch._dynamo.mark_dynamic(k, 3)
        torch._dynamo.mark_dynamic(v, 3)
        # freezing set through torch.compile(options=...) does not reach Inductor's freezing pass
        # (measured: no speed-up), so the config is patched around each call instead
        with torch._inductor.config.patch(freezing=True, cpp_wrapper=cpp_wrapper, **autotune), \
                torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            return compiled(tokens, positions, k, v, lengths, block_mask)

    model._compiled_step = step
    return model
