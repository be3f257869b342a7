"""Hugging Face `transformers` baselines: plain generate(), assisted generation, prompt lookup.

The same checkpoint and dtype as the runtime model, loaded with
`AutoModelForCausalLM.from_pretrained`. Each model's generation config is replaced by a clean
one (only eos / pad ids), so that sampling defaults stored with a checkpoint (Qwen2.5 ships
`repetition_penalty=1.05`, `top_k=20`, ...) do not change what the baseline computes; greedy
means `do_sample=False`, `min_new_tokens` is never set. Assisted generation and prompt lookup use
transformers' own defaults apart from `prompt_lookup_num_tokens`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

from runtime.hardware import check_device
from runtime.loading import resolve
from runtime.validate import refuse_remote_code
from specdec.methods import METHODS, TRANSFORMERS

HF_MODES = tuple(kind for kind, e in METHODS.items() if e.engine == TRANSFORMERS)  # the kinds HFGenerator runs
# transformers' notice, on every assisted run, that its own assistant call passes a generation_config together
# with generation arguments: no caller can act on it, so HFGenerator's runs do not show it
GENERATION_CONFIG_NOTICE = "Passing `generation_config` together with generation-related arguments"


class _HideGenerationConfigNotice(logging.Filter):
    """Drops GENERATION_CONFIG_NOTICE, and only it, from transformers' generation logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(GENERATION_CONFIG_NOTICE)


_NOTICE_FILTER = _HideGenerationConfigNotice()


def load_hf_model(name_or_path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                  eos_token_id: list[int] | None = None, pad_token_id: int | None = None):
    """A transformers causal LM for a catalogue name, checkpoint dir, .gguf file or hub id.

    Like `runtime.load_model`, it refuses a device this machine lacks (ValueError) and a checkpoint
    that asks to run its own code (`auto_map`: UnsupportedModelError), and never lets transformers
    run such code (trust_remote_code=False).
    """
    from transformers import AutoModelForCausalLM  # transformers' modeling code takes seconds: on first use

    device = check_device(device)
    ckpt = resolve(name_or_path)
    refuse_remote_code(ckpt)
    # no bar of transformers' own: loading takes seconds and happens inside a run's one progress bar
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, trust_remote_code=False)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    model = model.to(device).eval().requires_grad_(False)
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    return model


def new_tokens(output: list[int], eos: set[int] | frozenset[int]) -> list[int]:
    """Generated tokens up to and including the first eos (how every method counts tokens)."""
    for i, t in enumerate(output):
        if t in eos:
            return output[:i + 1]
    return output


class HFGenerator:
    """transformers generate() for one prompt at a time, in one of HF_MODES."""

    def __init__(self, model, mode: str = "hf", assistant=None, prompt_lookup_num_tokens: int = 10) -> None:
        if mode not in HF_MODES:
            raise ValueError(f"unknown transformers baseline {mode!r}; choose one of {', '.join(HF_MODES)}")
        if (mode == "hf-assisted") != (assistant is not None):
            raise ValueError("hf-assisted needs an assistant model, and only hf-assisted takes one")
        if prompt_lookup_num_tokens < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {prompt_lookup_num_tokens}")
        self.model, self.mode, self.assistant = model, mode, assistant
        logging.getLogger("transformers.generation.utils").addFilter(_NOTICE_FILTER)  # added once
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0) -> list[int]:
        """New token ids for one prompt (up to and including the model's eos, see load_hf_model)."""
        device = self.model.device
        ids = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
        kwargs: dict = {"max_new_tokens": max_new_tokens, "attention_mask": torch.ones_like(ids)}
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
        else:
            kwargs.update(do_sample=False)
        if self.mode == "hf-assisted":
            kwargs["assistant_model"] = self.assistant
        elif self.mode == "hf-pld":
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        out = self.model.generate(ids, **kwargs)  # (1, T + new)
        eos = self.model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return new_tokens(out[0, len(prompt):].tolist(), frozenset(eos))
