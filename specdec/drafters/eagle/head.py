"""EAGLE-3 draft heads (Li et al. 2025), in the layout of the speculators `eagle3` format.

The head drafts in the target's feature space. The target's hidden states entering three of its
layers (low, middle, high; by convention 2, L // 2 and L - 3, numbered as vLLM does: layer i's
input, 0 = the embedding) are concatenated (B, T, 3C) and fused by `fc` (3C -> C, no bias).
One decoder layer then reads [input_layernorm(embedding of the next token),
hidden_norm(fused)] (2C: q/k/v projections take 2C), with the fused state (or its normed copy,
`norm_before_residual`) as the residual, the target's RoPE and grouped-query shape, and its own
one-layer KV cache; `norm` and `lm_head` score a draft vocabulary of `draft_vocab_size` tokens.
Options of later speculators versions (off unless a config sets them): `norm_before_fc` (one
RMSNorm `input_norm` over the concatenated 3C states before `fc`), `fc_norm` (one RMSNorm per
layer's C states, `fc_norm.{i}`, instead) and `norm_output` (the next step reads the head's
output after `norm`, not before; Eagle 3.1).
`d2t` maps a draft id d to the target id d + d2t[d]; `t2d` marks the target ids the draft
vocabulary holds. The embedding is the target's (frozen, not stored with the head).

Alignment (as speculators trains it): the step at position t reads the target's states behind
token t - 1 and the embedding of token t, and predicts token t + 1. Its output hidden state
(before `norm`, or after it with `norm_output`) is what the next step reads instead of fused
target states, so drafting (and training-time test) unrolls the head on its own outputs.

    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=32768))
    fused = head.fuse(aux)                                             # (B, T, C)
    logits, hidden = head(fused, target.embed(tokens), positions)      # (B, T, Vd), (B, T, C)

Training-time test unrolls steps over one `UnrollCache`: step s reads the previous step's output
hidden states, the embeddings of the tokens one further on and positions + s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.attention import attend, causal_mask, default_backend
from runtime.cache import KVCache
from runtime.config import is_size
from runtime.model import RMSNorm
from runtime.rope import Rope, apply_rope

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high layers of a target with `num_layers` layers: (2, L // 2, L - 3)."""
    return 2, num_layers // 2, num_layers - 3


def rope_parameters(hf_config: Any) -> dict:
    """The RoPE description of a transformers config, as a `rope_parameters` dict."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    return {"rope_type": "default", "rope_theta": float(getattr(hf_config, "rope_theta", 10000.0))}


@dataclass(frozen=True)
class Eagle3Config:
    """Shapes of an EAGLE-3 head for one target (validated on construction).

    hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps,
    max_position_embeddings and rope_parameters are the target's (`from_target`); vocab_size is
    the target's vocabulary, draft_vocab_size the head's (<= vocab_size); aux_layers the three
    target layers whose input states the head reads (each in 0..num_target_layers - 1);
    norm_before_residual: the decoder layer's residual is the normed fused state instead of the
    fused state itself; norm_before_fc / fc_norm: RMSNorm the concatenated aux states as one
    vector / per layer before `fc` (at most one of them); norm_output: a step's output hidden
    state is taken after `norm` (what the next step reads and `lm_head` scores); target: the
    verifier's name or path, recorded in the checkpoint.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    num_target_layers: int
    aux_layers: tuple[int, ...]
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: dict(DEFAULT_ROPE))
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    target: str = ""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                     "draft_vocab_size", "num_target_layers", "max_position_embeddings"):
            if not is_size(getattr(self, name)):
                raise ValueError(f"Eagle3Config.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Eagle3Config.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"Eagle3Config.draft_vocab_size ({self.draft_vocab_size}) exceeds the target's "
                             f"vocabulary ({self.vocab_size})")
        layers = tuple(self.aux_layers) if isinstance(self.aux_layers, (list, tuple)) else None
        L = self.num_target_layers
        if layers is None or len(layers) != 3 or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L for i in layers):
            raise ValueError(f"Eagle3Config.aux_layers must be 3 layer ids in 0..{L - 1} (the target has {L} "
                             f"layers), got {self.aux_layers!r}")
        object.__setattr__(self, "aux_layers", layers)
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise ValueError(f"Eagle3Config.rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if not isinstance(self.rope_parameters, dict) or "rope_theta" not in self.rope_parameters:
            raise ValueError(f"Eagle3Config.rope_parameters must be a dict with a rope_theta, got "
                             f"{self.rope_parameters!r}")
        for name in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Eagle3Config.{name} must be a bool, got {getattr(self, name)!r}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("Eagle3Config.norm_before_fc and fc_norm exclude each other: one norm over the "
                             "concatenated aux states, or one per layer")
        if not isinstance(self.target, str):
            raise ValueError(f"Eagle3Config.target must be a string, got {self.target!r}")

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = None, aux_layers: tuple[int, ...] | None = None,
                    norm_before_residual: bool = False, target_name: str = "", **norms: bool) -> Eagle3Config:
        """The head shape for runtime model `target` (its sizes, RoPE and GQA shape). Defaults: the
        full vocabulary, aux layers (2, L // 2, L - 3) (targets of fewer than 4 layers need them
        given), target_name from the target's config (`_name_or_path`); `norms`: norm_before_fc,
        fc_norm, norm_output."""
        cfg = target.config
        name = target_name or str(getattr(cfg.hf_config, "_name_or_path", "") or "")
        return cls(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                   draft_vocab_size=draft_vocab_size or cfg.vocab_size, num_target_layers=cfg.num_layers,
                   aux_layers=default_aux_layers(cfg.num_layers) if aux_layers is None else tuple(aux_layers),
                   max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
                   rope_parameters=rope_parameters(cfg.hf_config), norm_before_residual=norm_before_residual,
                   target=name, **norms)

    def layer_config(self) -> dict:
        """The decoder layer as a transformers LlamaConfig dict (speculators' `transformer_layer_config`)."""
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": 1, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
                "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
                "rope_parameters": dict(self.rope_parameters), "rope_theta": self.rope_parameters["rope_theta"],
                "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}

    def to_dict(self) -> dict:
        """JSON-ready fields (aux_layers as a list)."""
        out = asdict(self)
        out["aux_layers"] = list(self.aux_layers)
        return out


class UnrollCache:
    """The keys and values of earlier unrolled steps for training-time test, kept by concatenation
    (no in-place writes, so gradients flow through every step); holds steps of T positions each.

    Without a mask, step s (0-based) of a position t sees step 0 at positions <= t and steps
    1..s at position t only: EAGLE-3's training-time-test attention (each unrolled draft extends
    its own position's branch)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (B, Hkv, S, D)
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add one step's k, v (B, Hkv, T, D); returns every step's keys and values (B, Hkv, S, D)."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    @staticmethod
    def mask(T: int, steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(T, steps * T) bool: the training-time-test mask of step `steps` - 1 (see the class)."""
        t, j = torch.arange(T, device=device), torch.arange(steps * T, device=device)
        block, col = j // T, j % T
        return torch.where(block[None] == 0, col[None] <= t[:, None], col[None] == t[:, None])


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose q/k/v read 2C ([embedding, fused]); the head's one cache layer."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | UnrollCache | None,
                mask: torch.Tensor | None, backend: str = "sdpa") -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        prefix = torch.zeros(B, dtype=torch.long, device=x.device)
        if cache is None:
            keys, values = k, v
        elif isinstance(cache, UnrollCache):
            backend = "sdpa"  # training: the Triton kernel has no backward
            keys, values = cache.append(k, v)  # (B, Hkv, S, D)
            if mask is None:
                mask = UnrollCache.mask(T, keys.shape[2] // T, x.device)[None].expand(B, T, -1)  # (B, T, S)
        else:
            cache.check_room(T)
            prefix = cache.lengths.clone()  # (B,)
            cache.write(0, k, v, cache.slots(T))
            num_keys = mask.shape[-1] if mask is not None else int(prefix.max()) + T
            keys, values = cache.k[0][:, :, :num_keys], cache.v[0][:, :, :num_keys]  # (B, Hkv, S, D)
        if mask is None and backend == "sdpa":  # (the Triton kernel masks causally in-kernel)
            mask = causal_mask(prefix, T, keys.shape[2])  # (B, T, S)
        out = attend(q, keys, values, mask, prefix, backend)  # (B, Hq, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    """SwiGLU feed-forward with the Llama names (gate_proj, up_proj, down_proj)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The head's decoder layer (speculators' Eagle3 first layer): attention over
    [input_layernorm(embeds), hidden_norm(hidden)], residual `hidden` (or its normed copy)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | UnrollCache | None, mask: torch.Tensor | None, backend: str = "sdpa") -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # (B, T, 2C)
        x = residual + self.self_attn(x, cos, sin, cache, mask, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """fc (3C -> C), one decoder layer `layers.0`, `norm`, `lm_head` over the draft vocabulary, and
    the vocabulary maps `d2t` (Vd,) int64 and `t2d` (V,) bool (default: the first Vd target ids).

    `attention`: the attention backend of drafting ("sdpa" or "triton", as runtime.attention.attend
    takes it; None = runtime.attention.default_backend of the head's device); the EAGLE drafter sets
    its target's. Training-time test always runs SDPA (the Triton kernel has no backward)."""

    def __init__(self, config: Eagle3Config, attention: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.attention = attention
        C = config.hidden_size
        self.input_norm = RMSNorm(3 * C, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(C, config.rms_norm_eps) for _ in range(3)) if config.fc_norm else None
        self.fc = nn.Linear(3 * C, C, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = RMSNorm(C, config.rms_norm_eps)
        self.lm_head = nn.Linear(C, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[:config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self._rope: Rope | None = None

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self) -> Rope:
        """The target's cos/sin tables (built from `config.layer_config()`), on the head's device."""
        if self._rope is None or self._rope.cos.device != self.device:
            from transformers import LlamaConfig  # transformers' Llama modules take seconds to import: on first use

            cfg = self.config
            self._rope = Rope(LlamaConfig(**cfg.layer_config()), cfg.head_dim, cfg.max_position_embeddings,
                              self.device)
        return self._rope

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Make draft id d stand for target id token_ids[d]: `token_ids` (Vd,) strictly increasing
        target ids (`specdec.drafters.draft_vocab.frequent_tokens` returns such a list)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
        Vd, V = self.config.draft_vocab_size, self.config.vocab_size
        if ids.numel() != Vd or int(ids.min()) < 0 or int(ids.max()) >= V or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"the draft vocabulary must be {Vd} strictly increasing target ids in 0..{V - 1}, got "
                             f"{ids.numel()} ids")
        self.d2t.copy_(ids - torch.arange(Vd))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids (any shape): d + d2t[d]."""
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three layers' states (B, T, 3C) -> the fused state (B, T, C) the head reads."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        elif self.fc_norm is not None:
            aux = torch.cat([norm(part) for norm, part in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return self.fc(aux)

    def new_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        """A one-layer KV cache of `batch_size` rows of `max_seq_len` slots for the head."""
        cfg = self.config
        return KVCache(1, batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim, dtype=self.dtype,
                       device=self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (..., Vd) of the head's output hidden states (..., C) (`step`'s: with
        norm_output already normed)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    def step(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
             cache: KVCache | UnrollCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` without the LM head: the layer's output hidden state (B, T, C) (after `norm` with
        norm_output)."""
        cos, sin = self.rope()(positions, self.dtype)
        backend = self.attention or default_backend(self.device)
        out = self.layers[0](hidden, embeds, cos, sin, cache, mask, backend)  # (B, T, C)
        if isinstance(cache, KVCache):
            cache.lengths += hidden.shape[1]
        return self.norm(out) if self.config.norm_output else out

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | UnrollCache | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step over T positions -> draft-vocabulary logits (B, T, Vd) and the layer's output
        hidden state (B, T, C), the `hidden` input of the next unrolled step.

        hidden (B, T, C): `fuse(aux)` of the target's states behind the previous tokens, or the head's
        own previous output; embeds (B, T, C): the target's embedding of the tokens at `positions`
        (B, T). Without a cache: causal attention over the T positions. With a KVCache (drafting):
        the keys and values go to slots cache.lengths[b] + t and the lengths advance by T; `mask`
        (B, T, S) bool over the first S slots (the new ones included) says what each position sees,
        None = causal. With an UnrollCache (training-time test, autograd-safe): this step's keys and
        values join the earlier steps'; None = EAGLE-3's unrolled mask (`UnrollCache.mask`).
        """
        out = self.step(hidden, embeds, positions, cache, mask)
        return self.logits(out), out
