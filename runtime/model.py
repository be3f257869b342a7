"""Transformer: one Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral, SmolLM) over a static KV cache.

Layout follows gpt-fast: q/k/v and gate/up projections are fused into one linear each
(`attn.wqkv`, `mlp.w13`), which halves the kernel launches of a decode step. The model is
built on the `meta` device and its weights are assigned from safetensors by `runtime.loading`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.args import check_int
from runtime.attention import attend, block_mask_keys, causal_mask, default_backend, static_cache_attention
from runtime.cache import KVCache
from runtime.compile import (
    DECODE_STATIC_TOKENS,
    MAX_BLOCK_TOKENS,
    MAX_STATIC_TOKENS,
    Regions,
    Step,
    compile_step,
    static_tokens,
)
from runtime.config import ModelConfig
from runtime.invariant import attention as invariant_attention
from runtime.invariant import linear, unsupported_reason
from runtime.model_output import ModelOutput, check_aux_layers
from runtime.paged_cache import PagedKVCache
from runtime.rope import Rope, apply_rope, rope_at

# how many submodules have been registered in this process (any module's attribute set to a module,
# `add_module`): a module swap anywhere bumps it, so `Transformer._has_dense_linear` knows to rescan
_module_registrations = 0
# model -> (module registrations when it was scanned, whether it has a dense nn.Linear); kept off the model so
# that a forward sets no attribute on it
_dense_scans: weakref.WeakKeyDictionary[nn.Module, tuple[int, bool]] = weakref.WeakKeyDictionary()


def _count_registration(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    global _module_registrations
    _module_registrations += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as Hugging Face Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    """Grouped-query self-attention that reads and writes one layer of the static cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, cfg.qkv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: "StepContext",
                layer: int) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); layer: this layer's index in the cache (0 in a compiled step, whose
        cache buffers are this layer's alone)."""
        B, T, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = linear(self.wqkv, x, ctx.invariant).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ctx.backend == "static":  # Transformer.static_step: cache write + attention as one op
            out = static_cache_attention(q, k, v, ctx.cache.k, ctx.cache.v, layer, ctx.prefix_lens,
                                         ctx.window or 0, ctx.block_mask, ctx.invariant, ctx.cache.block_table)
        else:
            out = _eager_attention(q, k, v, ctx, layer)
        return linear(self.wo, out.transpose(1, 2).reshape(B, T, q_size), ctx.invariant)


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: "StepContext",
                     layer: int) -> torch.Tensor:
    """An eager forward's attention: k, v (B, Hkv, T, D) written into the cache (if any), then q
    (B, Hq, T, D) over its slots -> (B, Hq, T, D). The row-invariant kernel reads a paged cache's pools
    through its table; the other kernels read its used blocks gathered."""
    if ctx.cache is None:
        keys, values = k, v
    else:
        ctx.cache.write(layer, k, v, ctx.slots, ctx.uniform)
        table = ctx.cache.block_table
        if ctx.invariant and table is not None:
            return invariant_attention(q, ctx.cache.k[layer], ctx.cache.v[layer], ctx.mask, ctx.prefix_lens,
                                       ctx.window, table, ctx.num_keys)
        keys, values = ctx.cache.layer_kv(layer, ctx.num_keys)  # (B, Hkv, S, D)
    if ctx.invariant:
        return invariant_attention(q, keys, values, ctx.mask, ctx.prefix_lens, ctx.window)
    return attend(q, keys, values, ctx.mask, ctx.prefix_lens, ctx.backend, ctx.window)


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); invariant: row-invariant linears (`runtime.invariant.linear`)."""
        gate, up = linear(self.w13, x, invariant).split(self.intermediate_size, dim=-1)
        return linear(self.w2, F.silu(gate) * up, invariant)


class _CacheBuffers:
    """One layer's cache buffers (1, B, H, S_max, D), or a paged cache's pools (1, NB, H, bs, D) and
    its block table (B, W), that a compiled step writes through `cache_attention`."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None) -> None:
        self.k, self.v, self.block_table = k, v, block_table


class Block(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: "StepContext",
                layer: int) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); layer: the index of this layer's cache (`Attention.forward`)."""
        x = x + self.attn(self.attn_norm(x), cos, sin, ctx, layer)
        return x + self.mlp(self.mlp_norm(x), ctx.invariant)


class StepContext:
    """What every layer of one forward pass shares: cache, write slots, mask, backend.

    backend "sdpa" / "triton": eager attention (`runtime.attention.attend`) over `num_keys` slots,
    the new keys and values written first at `slots` (B, T) when there is a cache; "static": the
    compiled step's fused cache write + attention (`runtime.attention.cache_attention`).
    invariant: the linears and the attention run `runtime.invariant`'s row-invariant kernels.
    """

    def __init__(self, *, cache: KVCache | _CacheBuffers | None, prefix_lens: torch.Tensor, backend: str,
                 window: int | None, num_keys: int, slots: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, uniform: bool = False,
                 block_mask: torch.Tensor | None = None, invariant: bool = False) -> None:
        self.cache, self.prefix_lens, self.backend, self.window = cache, prefix_lens, backend, window
        self.num_keys, self.slots, self.mask = num_keys, slots, mask
        self.uniform = uniform  # every row writes to the same slots
        self.block_mask = block_mask  # (B, T, T) for the "static" backend; eager folds it into mask
        self.invariant = invariant  # row-invariant linears and attention (`runtime.invariant`)


def _static_layer(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, lengths: torch.Tensor, window: int, block_mask: torch.Tensor | None,
                  invariant: bool, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder layer of `Transformer.static_step`, a compiled region: x (B, T, C) -> (B, T, C); k, v
    are this layer's cache buffers (1, B, H, S_max, D), or a paged cache's pools (1, NB, H, bs, D) with
    its `block_table` (B, W); window 0 = none."""
    ctx = StepContext(cache=_CacheBuffers(k, v, block_table), prefix_lens=lengths, backend="static",
                      window=window or None, num_keys=k.shape[3], block_mask=block_mask, invariant=invariant)
    return block(x, cos, sin, ctx, 0)


def _static_prologue(embed: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The embedding and rope of `Transformer.static_step`, a compiled region (eagerly, a 4-bit table's
    row lookup and the rope's gathers are ~20 small ops, ~0.1 ms a step): tokens, positions (B, T) ->
    x (B, T, C), cos, sin (B, 1, T, D) in `dtype`, read from the rope's tables cos, sin (P, D)."""
    return embed(tokens), *rope_at(cos, sin, positions, dtype)


def _static_head(norm: RMSNorm, lm_head: nn.Module, x: torch.Tensor,
                 invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The final norm and LM head of `Transformer.static_step`, a compiled region: x (B, T, C) ->
    (logits (B, T, V), hidden (B, T, C))."""
    h = norm(x)
    return linear(lm_head, h, invariant), h


class Transformer(nn.Module):
    """Decoder-only Llama-family model: forward(tokens, positions, cache, mask) -> ModelOutput.

    `compile_decode()` compiles the short forwards into `compiled_step` (None = eager), which
    `forward` then takes whenever the forward fits it (`runtime.compile`).
    """

    def __init__(self, cfg: ModelConfig, attention: str | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.attention = attention
        self._rope: Rope | None = None
        # the compiled `static_step` (set by `compile_decode`; None = eager). `forward` calls whatever
        # this holds, so a wrapper assigned here (a call counter in a test) sees every compiled step
        self.compiled_step: Step | None = None
        self.row_cost = False  # set by compile_decode
        self.want_row_invariant = True  # see `row_invariant`

    @property
    def row_invariant(self) -> bool:
        """Whether forwards over a filled cache are row-invariant (`runtime.invariant`): each row's
        logits are the same bits whatever the number of tokens, rows and padding in the forward,
        so greedy speculative decoding equals plain decoding token for token. On by default where
        supported (bf16 on the CPU with the C++ kernels, float32 there when every linear is
        block-quantized: `runtime.invariant.unsupported_reason`); set `want_row_invariant = False` for
        the batch-dependent kernels. A constant to `torch.compile` (it guards on the attribute)."""
        if not self.want_row_invariant:
            return False
        dense = self.dtype != torch.float32 or self._has_dense_linear()
        return unsupported_reason(self.device, self.dtype, dense) is None

    def _has_dense_linear(self) -> bool:
        """Whether any submodule is a dense `nn.Linear`: scanned once per module-tree version (`row_invariant`
        is read every forward), rescanned after any module is registered anywhere."""
        version = _module_registrations
        scan = _dense_scans.get(self)
        if scan is None or scan[0] != version:
            scan = _dense_scans[self] = (version, any(type(m) is nn.Linear for m in self.modules()))
        return scan[1]

    @property
    def compiled(self) -> bool:
        """Whether `compile_decode` compiled this model's short forwards."""
        return self.compiled_step is not None

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's weight; an embedding may be quantized)."""
        return self.norm.weight.dtype

    def rope(self) -> Rope:
        """The cos/sin tables, built on the model's device on first use."""
        if self._rope is None or self._rope.cos.device != self.device:
            self._rope = Rope(self.config.hf_config, self.config.head_dim,
                              self.config.max_position_embeddings, self.device)
        return self._rope

    def compile_decode(self, cpp_wrapper: bool = True, max_autotune: bool | None = None) -> Transformer:
        """Compile this model's short forwards in place and return the model (`runtime.compile`).

        Sets `compiled_step` to `static_step` run through compiled programs: one per decoder-layer kind
        and shape, one each for the embedding (with the rope) and the head. cpp_wrapper: let Inductor
        call each program's kernels from C++ rather than Python (less per-call overhead). max_autotune:
        True lets Inductor also generate its own GEMM kernels (CPU: the CPP GEMM template, which covers
        the packed INT8 / INT4 weight-only matmuls) and keep the fastest per shape, compiling several
        times longer; None leaves Inductor's setting alone. Outputs equal the eager model's up to
        floating-point reassociation (float32: ~1e-6 relative; bf16: bf16 rounding), so greedy tokens
        can differ from the eager model's only at near-ties. Compile after the modules and weights are
        final.
        """
        self.compiled_step = compile_step(self.static_step, self.device, cpp_wrapper, max_autotune,
                                          eager_rounding=lambda: self.row_invariant,
                                          dynamic={_static_layer: ((3, 3), (4, 3))},  # the cache length
                                          reduction_size=self.config.hidden_size)  # the norms'
        # linears whose kernels cost per row (ROW_COST: runtime.blockq, the packed INT8 / INT4 ones) make
        # compiled steps pad blocks to 2, 4, 8, ... tokens rather than to 8 (runtime.compile.static_tokens)
        self.row_cost = any(getattr(m, "ROW_COST", False) for m in self.modules())
        return self

    def new_cache(self, batch_size: int, max_seq_len: int, paged_tokens: int | None = None) -> KVCache:
        """A static cache for `batch_size` rows of up to `max_seq_len` tokens (checked for memory); both
        must be integers >= 1 (TypeError / ValueError naming the argument). paged_tokens: a paged cache
        (`runtime.paged_cache.PagedKVCache`) whose rows share a pool of that many positions, instead of
        `batch_size` x `max_seq_len` slots of their own."""
        batch_size = check_int("batch_size", batch_size, minimum=1)
        max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1)
        cfg = self.config
        if self.compiled:  # room for the padded tokens of a compiled step
            max_seq_len += MAX_STATIC_TOKENS
        if paged_tokens is not None:
            paged_tokens = check_int("paged_tokens", paged_tokens, minimum=1)
            return PagedKVCache(cfg.num_layers, batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim,
                                paged_tokens, dtype=self.dtype, device=self.device)
        return KVCache(cfg.num_layers, batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim,
                       dtype=self.dtype, device=self.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                mask: torch.Tensor | None = None, return_hidden: bool = False,
                logits_idx: torch.Tensor | None = None, block_mask: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = (), eager: bool = False) -> ModelOutput:
        """Score `tokens` (B, T) at `positions` (B, T).

        With a cache, the new keys/values go to slots cache.lengths[b] + t and the lengths
        advance by T. `mask` (B, T, S) bool, True = may attend, over the first S cache slots
        (the new tokens included); None = causal. `block_mask` (B, T, T) bool instead says only
        which new tokens each new token sees (a Medusa tree: its ancestors), every cached slot
        being visible (`runtime.attention.block_mask_keys`). `logits_idx` (B, N) picks the
        positions to score (the LM head is the largest matmul of a long prefill). Returns a
        ModelOutput: logits (B, T|N, V), the final hidden states (B, T, C) when `return_hidden`,
        the states entering each of `aux_layers` (B, T, len(aux_layers) * C) when it names some
        (layer i's input, 0 = the embedding); the fields not asked for are None.

        On a compiled model, a forward with a cache and no `mask` runs through `compiled_step`
        when it fits (`_static_fits`), else eagerly (always with `eager`: a prefill compiles no
        program of its length); both run the same layers (`_run`). On a
        `row_invariant` model every forward with a cache, prefills included, runs the
        row-invariant linears and attention (`runtime.invariant`): a token's keys and logits do
        not depend on how its prompt was split between forwards (a prefix cache reuses them).
        """
        if mask is not None and block_mask is not None:
            raise ValueError("pass either mask (B, T, S) or block_mask (B, T, T), not both")
        aux_layers = check_aux_layers(aux_layers, self.config.num_layers)
        T = tokens.shape[1]
        if self.compiled and cache is not None and mask is None and not eager and self._static_fits(
                T, cache, logits_idx is not None, block_mask is not None):
            logits, h, aux = self._static_forward(tokens, positions, cache, logits_idx is not None, block_mask,
                                                  aux_layers)
            if logits_idx is not None:
                logits = logits.gather(1, logits_idx[:, :, None].expand(-1, -1, logits.shape[-1]))  # (B, N, V)
        else:
            ctx = self._eager_context(positions, cache, mask, block_mask)
            logits, h, aux = self._run(tokens, positions, ctx, logits_idx, aux_layers)
            if cache is not None:
                cache.lengths += T
        return ModelOutput(logits, h if return_hidden else None, aux)

    def static_step(self, tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, lengths: torch.Tensor, block_mask: torch.Tensor | None = None,
                    aux_layers: tuple[int, ...] = (), regions: Regions | None = None,
                    block_table: torch.Tensor | None = None) -> ModelOutput:
        """A short forward over the static cache buffers -> ModelOutput: logits (B, T, V), the final
        hidden states (B, T, C) always, and the states entering `aux_layers` (B, T, len * C) when it
        names some.

        The same layers as `forward` with a cache (`_run`), written so that `torch.compile` traces
        each layer once per shape: no host syncs, and each layer's cache write + attention is one
        opaque in-place op (`runtime.attention.cache_attention`) over that layer's buffers, so the
        cache length may vary freely. k, v: the cache buffers (L, B, H, S_max, D), written at slots
        lengths[b] + t; `lengths` (B,) is not advanced here; with a `block_table` (B, W), k and v are a
        paged cache's pools (L, NB, H, bs, D) (`runtime.paged_cache`). block_mask: (B, T, T) which new tokens
        each one sees (None = causal). regions: run each layer and the head through their compiled
        programs (`runtime.compile.Regions`); None runs them eagerly.
        """
        invariant, window = self.row_invariant, self.config.sliding_window or 0

        def step(i: int, layer: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            args = (x, cos, sin, k[i:i + 1], v[i:i + 1], lengths, window, block_mask, invariant, block_table)
            return _static_layer(layer, *args) if regions is None else regions.run(_static_layer, i, (layer,), *args)

        def prologue(tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
            rope = self.rope()
            args = (tokens, positions, rope.cos, rope.sin, self.dtype)
            if regions is None:
                return _static_prologue(self.embed, *args)
            return regions.run(_static_prologue, "prologue", (self.embed,), *args)

        x, aux = self._layers(tokens, positions, step, aux_layers, prologue)
        if regions is None:
            logits, h = _static_head(self.norm, self.lm_head, x, invariant)
        else:
            logits, h = regions.run(_static_head, "head", (self.norm, self.lm_head), x, invariant)
        return ModelOutput(logits, h, aux)

    def run_block(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Decoder layer `i` alone on hidden states x (B, T, C) at `positions` (B, T) -> (B, T, C).

        No cache: causal attention over the T tokens of x (and the sliding window, if any). For
        layer-wise calibration (`quant.layerwise`): chained over every layer from `embed(tokens)`,
        then `norm`, it gives the hidden states of `forward(tokens, positions, None)`.
        """
        cos, sin = self.rope()(positions, self.dtype)
        return self.layers[i](x, cos, sin, self._eager_context(positions, None, None, None), i)

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, step: Callable[..., torch.Tensor],
                aux_layers: tuple[int, ...], prologue: Callable[..., tuple[torch.Tensor, ...]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding, then step(i, layer, x, cos, sin) -> x over every layer -> (x (B, T, C), the states
        entering `aux_layers` (B, T, len(aux_layers) * C) or None). prologue(tokens, positions) -> x, cos,
        sin replaces the embedding and rope (the same values: a compiled step's region)."""
        if prologue is None:
            cos, sin = self.rope()(positions, self.dtype)
            x = self.embed(tokens)  # (B, T, C)
        else:
            x, cos, sin = prologue(tokens, positions)
        entering = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                entering[i] = x
            x = step(i, layer, x, cos, sin)
        return x, torch.cat([entering[i] for i in aux_layers], dim=-1) if aux_layers else None

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
             logits_idx: torch.Tensor | None = None, aux_layers: tuple[int, ...] = ()) -> ModelOutput:
        """The one forward body: embedding -> layers -> final norm -> LM head.

        Returns logits (B, T|N, V) (only at `logits_idx` (B, N) when given), hidden (B, T, C) and
        the states entering `aux_layers` (B, T, len(aux_layers) * C), None when there are none.
        """
        x, aux = self._layers(tokens, positions, lambda i, layer, x, cos, sin: layer(x, cos, sin, ctx, i),
                              aux_layers)
        h = self.norm(x)
        if logits_idx is not None:
            h_sel = h.gather(1, logits_idx[:, :, None].expand(-1, -1, h.shape[-1]))  # (B, N, C)
            return ModelOutput(linear(self.lm_head, h_sel, ctx.invariant), h, aux)  # (B, N, V)
        return ModelOutput(linear(self.lm_head, h, ctx.invariant), h, aux)

    def _eager_context(self, positions: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None,
                       block_mask: torch.Tensor | None) -> StepContext:
        """The context of an eager forward of positions.shape = (B, T) new tokens (checks the cache's room)."""
        B, T = positions.shape
        if cache is None:
            prefix = torch.zeros(B, dtype=torch.long, device=positions.device)
            slots, num_keys = None, T
        else:
            cache.check_room(T)
            prefix = cache.lengths.clone()
            slots = cache.slots(T)  # (B, T)
            num_keys = mask.shape[-1] if mask is not None else int(prefix.max()) + T
        backend = self.attention or default_backend(positions.device)
        window = self.config.sliding_window
        if block_mask is not None:
            mask = block_mask_keys(prefix, block_mask, num_keys, positions, window)  # (B, T, S)
        uniform = B == 1 or bool((prefix == prefix[0]).all())
        invariant = cache is not None and backend == "sdpa" and self.row_invariant
        # causal: SDPA takes a mask, built once per forward rather than per layer; the Triton and the
        # row-invariant kernels apply causality and the window themselves (a (B, T, S) mask costs the
        # row-invariant kernel a scan of it per query: ~14% of its time in a 2,048-token prefill)
        if mask is None and backend == "sdpa" and not invariant:
            mask = causal_mask(prefix, T, num_keys, window)
        return StepContext(cache=cache, prefix_lens=prefix, backend=backend, window=window, num_keys=num_keys,
                           slots=slots, mask=mask, uniform=uniform, invariant=invariant)

    def _static_fits(self, T: int, cache: KVCache, selected: bool, block: bool) -> bool:
        """Whether a forward of T tokens can take the compiled program: causal steps of up to
        MAX_STATIC_TOKENS (DECODE_STATIC_TOKENS with selected logits), block-mask steps without
        selected logits of up to MAX_BLOCK_TOKENS whose rows the sliding window (if any) does not cut."""
        if not block:
            return T <= (DECODE_STATIC_TOKENS if selected else MAX_STATIC_TOKENS)
        window = self.config.sliding_window
        return (not selected and T <= MAX_BLOCK_TOKENS
                and (window is None or int(cache.lengths.max()) + T <= window))

    def verify_tokens(self, T: int, batch_size: int = 1) -> int:
        """The tokens per row that a verification forward of T tokens (a causal block or a tree, all
        logits) runs with: padded as the compiled step pads it, T itself on an eager model or past
        the compiled sizes. What a block's cost follows (`specdec.tuning.autok`)."""
        if not self.compiled or T > MAX_STATIC_TOKENS:
            return T
        return self._padded_tokens(batch_size, T, False, False)

    def _padded_tokens(self, B: int, T: int, selected_after_prompt: bool, block: bool) -> int:
        """The tokens a compiled forward of (B, T) tokens runs with (before the cache's room is
        checked): `static_tokens` for causal steps and trees of up to DECODE_STATIC_TOKENS."""
        if block:  # a small tree (a suffix match's) changes size every step: padded like a causal block
            return static_tokens(T, row_cost=self.row_cost) if T <= DECODE_STATIC_TOKENS else T
        return static_tokens(T, selected_after_prompt, self.row_cost)

    def _static_forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                        selected: bool, block_mask: torch.Tensor | None = None,
                        aux_layers: tuple[int, ...] = ()) -> ModelOutput:
        """`forward` through `compiled_step` -> ModelOutput(logits (B, T, V), hidden (B, T, C), aux
        states (B, T, len(aux_layers) * C) or None); advances the cache.

        A causal step's T is padded by `static_tokens`, and so is a block-mask step (a tree) of up to
        DECODE_STATIC_TOKENS tokens; a larger tree (Medusa's, EAGLE's: one size for a whole
        generation) runs at its own T."""
        B, T = tokens.shape
        cache.check_room(T)
        filled = int(cache.lengths.max())
        # selected logits after the prompt: a draft's catch-up feed (a 2-token prompt stays padded,
        # so a target never compiles, with its own weight copy, a program only drafts need)
        padded = self._padded_tokens(B, T, selected and filled > 0, block_mask is not None)
        if filled + padded > cache.max_seq_len:
            padded = T  # no room for the padding at the very end of the cache: one more shape
        if padded > T:
            extra = torch.arange(1, padded - T + 1, device=tokens.device)  # (P,)
            last = self.config.max_position_embeddings - 1
            tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, padded - T)], dim=1)  # (B, T+P)
            positions = torch.cat([positions, (positions[:, -1:] + extra).clamp(max=last)], dim=1)
            if block_mask is not None:  # a padding token sees itself (and the cache) only
                grown = torch.eye(padded, dtype=torch.bool, device=block_mask.device).repeat(B, 1, 1)
                grown[:, :T, :T] = block_mask
                block_mask = grown  # (B, T+P, T+P)
        out = self.compiled_step(tokens, positions, cache.k, cache.v, cache.lengths, block_mask, aux_layers,
                                 cache.block_table)
        cache.lengths += T
        return ModelOutput(out.logits[:, :T], out.hidden[:, :T], None if out.aux is None else out.aux[:, :T])
