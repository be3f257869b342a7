"""Frequency-ranked draft vocabulary (FR-Spec, Zhao et al. 2025): a draft model that scores only
the tokens most frequent in ordinary text.

A small draft's LM head is its largest matmul when the vocabulary is large (qwen2.5-coder's
151,936 x 896); restricting it to the most frequent rows makes a draft step cheaper. The target
still verifies with its full vocabulary, so decoding stays lossless: at temperature 0 a token
outside the set is never proposed (that position is rejected and the target's own token taken);
when sampling, the draft's q is zero outside the set, which rejection sampling handles exactly.
What it costs is acceptance at the positions where the target's token is outside the set
(coverage and step times: docs/experiments/2026-11-22-quantized-drafts.md).

    ids = frequent_tokens(tokenizer, 65536, model.config.vocab_size)
    restrict_vocab(draft, ids)  # before runtime.compile_decode
    specdec.generate(target, prompt, draft=draft)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import nn

import runtime.data
from runtime.model import Transformer
from runtime.qlinear import Int4Linear, Int8Linear, QuantizedLinear

# default count texts: every turn of the first ShareGPT calibration conversations and Python files
# of installed packages, the sources of quant.calibration_batches(tok, "sharegpt+code") (8.8M
# tokens; the held-out ShareGPT prompts of `specdec eval` are never counted)
COUNT_CONVERSATIONS, COUNT_CODE_FILES = 4000, 400
ALIGN = 16  # rows of a packed INT4 head must be a multiple of 16 (the CPU kernel's tile)


def token_counts(tokenizer, texts: Iterable[str], vocab_size: int, batch_size: int = 256) -> torch.Tensor:
    """How often each token id occurs in `texts` (no special tokens added): (vocab_size,) int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    texts = iter(texts)
    while batch := list(itertools.islice(texts, batch_size)):
        ids = torch.tensor(list(itertools.chain.from_iterable(
            tokenizer(batch, add_special_tokens=False)["input_ids"])), dtype=torch.long)
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def default_texts() -> Iterable[str]:
    """ShareGPT calibration turns and installed packages' Python files (see COUNT_*)."""
    chat = (turn["content"] for conv in runtime.data.sharegpt_conversations("calibration", limit=COUNT_CONVERSATIONS)
            for turn in conv)
    return itertools.chain(chat, itertools.islice(runtime.data.python_package_texts(), COUNT_CODE_FILES))


def frequent_tokens(tokenizer, num_tokens: int, vocab_size: int,
                    texts: Iterable[str] | None = None) -> torch.Tensor:
    """The `num_tokens` ids a draft should score, sorted: every special token of `tokenizer` (eos and
    the chat markers must stay proposable) and then the most frequent ids in `texts` (default:
    `default_texts()`), ties broken by the lower id. num_tokens: a multiple of 16, <= vocab_size."""
    if not 0 < num_tokens <= vocab_size or num_tokens % ALIGN:
        raise ValueError(f"num_tokens must be a multiple of {ALIGN} in 1..{vocab_size} (the vocabulary), "
                         f"got {num_tokens}")
    counts = token_counts(tokenizer, default_texts() if texts is None else texts, vocab_size)
    special = [i for i in tokenizer.all_special_ids if 0 <= i < vocab_size]
    counts[special] = counts.max() + 1  # always kept
    order = torch.sort(counts, descending=True, stable=True).indices  # ties: lower id first
    return order[:num_tokens].sort().values


def restrict_vocab(model: nn.Module, token_ids: torch.Tensor) -> nn.Module:
    """Make the runtime model `model` score only `token_ids` (in place; returns it).

    Its forward then returns logits over those ids, in their order, and `model.output_ids` maps a
    column back to a token id; a drafter (specdec.drafters.ModelDrafter) does that mapping, and
    `specdec.generate` refuses such a model as a target. The LM head keeps its format (bf16, INT8,
    INT4 and GGUF block rows are sliced; other formats become a dense head of the kept rows). Call it before
    `runtime.compile_decode` (compiled programs hold the old head as a constant).
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"restrict_vocab takes a runtime Transformer (runtime.load_model), got "
                        f"{type(model).__name__}")
    if model.compiled:
        raise ValueError("restrict the vocabulary before runtime.compile_decode: the compiled "
                         "programs hold the full LM head")
    if getattr(model, "output_ids", None) is not None:
        raise ValueError("this model's vocabulary is already restricted")
    V = model.config.vocab_size
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if ids.numel() == 0 or ids.numel() % ALIGN or int(ids.min()) < 0 or int(ids.max()) >= V \
            or ids.unique().numel() != ids.numel():
        raise ValueError(f"token_ids must be distinct ids in 0..{V - 1}, a multiple of {ALIGN} of them "
                         f"(got {ids.numel()}); use frequent_tokens()")
    model.lm_head = _select_rows(model.lm_head, ids.to(model.device), model.dtype)
    model.output_ids = ids.cpu()  # drafters map columns to token ids on the host
    return model


def _select_rows(head: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """A head computing only output rows `ids` of `head`, in its own format where it can."""
    from runtime.blockq import BlockQuantLinear  # loads torch's compiler (about a second): not at CLI start

    if isinstance(head, BlockQuantLinear):
        return head.select_rows(ids)
    bias = None if head.bias is None else head.bias.detach()[ids]  # indexing copies
    if isinstance(head, Int4Linear):
        new = Int4Linear(head.qweight[ids], head.scales[ids], head.zeros[ids], head.group_size, bias)
    elif isinstance(head, Int8Linear):
        new = Int8Linear(head.qweight[ids], head.scales[ids], bias)
    else:
        weight = head.dequantize(dtype) if isinstance(head, QuantizedLinear) else head.weight.detach()
        new = nn.Linear(head.in_features, ids.numel(), bias=bias is not None, device="meta")
        new.weight = nn.Parameter(weight[ids], requires_grad=False)  # (N, in)
        if bias is not None:
            new.bias = nn.Parameter(bias, requires_grad=False)
    return new
