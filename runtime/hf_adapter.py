"""HFAdapter: drive any transformers PreTrainedModel through the runtime's model protocol.

The slower path for architectures the runtime does not implement. Each row keeps its own
`DynamicCache` and rows run one after another, so rows of different lengths, rollback (crop)
and tree compaction stay simple and exact. Masks are passed to transformers as 4-D masks.
Its forward returns the runtime's `ModelOutput` for every argument `Transformer.forward` takes:
the final and the aux layers' hidden states come from transformers' `output_hidden_states`
(entry i is layer i's input, the last one the final norm's output).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import DynamicCache

from runtime.attention import block_mask_keys
from runtime.model_output import ModelOutput, check_aux_layers


class HFCache:
    """Per-row DynamicCaches behind the KVCache interface (lengths, rollback, compact)."""

    def __init__(self, batch_size: int, max_seq_len: int, device: torch.device) -> None:
        self.rows = [DynamicCache() for _ in range(batch_size)]
        self.max_seq_len = max_seq_len
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def rollback(self, lengths: torch.Tensor) -> None:
        for b, cache in enumerate(self.rows):
            drop = int(self.lengths[b]) - int(lengths[b])
            if drop < 0:
                raise ValueError("rollback can only shorten rows")
            if drop:
                cache.crop(-drop)
        self.lengths.copy_(lengths)

    def compact(self, keep: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> None:
        for b, cache in enumerate(self.rows):
            s, n = int(start[b]), int(count[b])
            idx = torch.cat([torch.arange(s, device=keep.device), keep[b, :n]])
            for layer in cache.layers:
                layer.keys = layer.keys[:, :, idx]
                layer.values = layer.values[:, :, idx]
        self.lengths.copy_(start + count)


class HFAdapter(torch.nn.Module):
    """A transformers causal LM with the runtime signature model(tokens, positions, cache, mask)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.hf = model.eval()
        cfg = model.config
        self.config = SimpleNamespace(
            vocab_size=model.get_output_embeddings().weight.shape[0],
            hidden_size=cfg.hidden_size,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 1 << 20),
            model_type=cfg.model_type,
            num_layers=getattr(cfg, "num_hidden_layers", None),
            hf_config=cfg,
        )

    @property
    def device(self) -> torch.device:
        return self.hf.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.hf.get_output_embeddings()

    def new_cache(self, batch_size: int, max_seq_len: int) -> HFCache:
        return HFCache(batch_size, max_seq_len, self.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: HFCache | None,
                mask: torch.Tensor | None = None, return_hidden: bool = False,
                logits_idx: torch.Tensor | None = None, block_mask: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = (), eager: bool = False) -> ModelOutput:
        """Same contract as runtime.Transformer.forward (rows run one at a time): a ModelOutput.
        Every forward here is eager (`eager` is accepted for that contract).

        cache: an HFCache from `new_cache` (or None: no cache); a runtime KVCache is refused."""
        if cache is not None and not isinstance(cache, HFCache):
            raise TypeError(f"HFAdapter keeps its keys and values in transformers caches: pass cache=None or "
                            f"model.new_cache(...) (an HFCache), not a {type(cache).__name__}")
        if mask is not None and block_mask is not None:
            raise ValueError("pass either mask (B, T, S) or block_mask (B, T, T), not both")
        if aux_layers and self.config.num_layers is None:
            raise ValueError(f"HFAdapter cannot return aux_layers {tuple(aux_layers)}: the {self.config.model_type!r} "
                             "config names no num_hidden_layers")
        aux_layers = check_aux_layers(aux_layers, self.config.num_layers or 0)
        B, T = tokens.shape
        lengths = cache.lengths if cache is not None else torch.zeros(B, dtype=torch.long, device=tokens.device)
        if block_mask is not None:  # (B, T, T) -> (B, T, S) over each row's cache and the new tokens
            mask = block_mask_keys(lengths, block_mask, int(lengths.max()) + T)
        want_states = return_hidden or bool(aux_layers)
        logits_rows, hidden_rows, aux_rows = [], [], []
        for b in range(B):
            start = int(lengths[b])
            kwargs = {}
            if mask is not None:
                row_mask = mask[b, :, :start + T]  # (T, start + T)
                neg = torch.finfo(self.dtype).min
                kwargs["attention_mask"] = torch.zeros(row_mask.shape, dtype=self.dtype,
                                                       device=self.device).masked_fill(~row_mask, neg)[None, None]
            out = self.hf(input_ids=tokens[b:b + 1], position_ids=positions[b:b + 1],
                          past_key_values=None if cache is None else cache.rows[b], use_cache=cache is not None,
                          output_hidden_states=want_states, **kwargs)
            logits = out.logits  # (1, T, V)
            if logits_idx is not None:
                logits = logits[:, logits_idx[b]]
            logits_rows.append(logits)
            if return_hidden:
                hidden_rows.append(out.hidden_states[-1])  # (1, T, C), after the final norm
            if aux_layers:  # hidden_states[i]: layer i's input, 0 = the embedding
                aux_rows.append(torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1))  # (1, T, nC)
        if cache is not None:
            cache.lengths += T
        return ModelOutput(torch.cat(logits_rows), torch.cat(hidden_rows) if return_hidden else None,
                           torch.cat(aux_rows) if aux_layers else None)
