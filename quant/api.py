"""quantize_ / sparsify_: replace a model's nn.Linear modules in place with runtime.qlinear modules.

One verb per kind of compression, configured by a frozen config (quant.config). Round-to-
nearest formats work module by module; GPTQ, SparseGPT and Wanda calibrate layer by layer
(quant.layerwise). Each call appends its config to `model.compression_recipe`, which
`save_compressed` writes to compression.json.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase

import torch
from torch import nn

from quant.config import NF4, Config, Int4WeightOnly, Int8Mixed, Int8WeightOnly, SemiStructured24, config_to_dict
from quant.gptq import solve
from quant.grids import check_group_size, int4_module, int4_rtn, int8_rtn, mask_24
from quant.layerwise import compress_layerwise
from runtime.args import check_data, check_module, describe
from runtime.qlinear import Int8MixedLinear, NF4Linear, Sparse24Int4Linear, Sparse24Linear, pack_24_indices, pack_int4


def select_linears(model: nn.Module, cfg: Config) -> dict[str, nn.Linear]:
    """The plain nn.Linear modules `cfg` applies to, by fully-qualified name (model order)."""
    out = {}
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear:
            continue
        if name == "lm_head" and not cfg.include_lm_head:
            continue
        if not any(fnmatchcase(name, p) for p in cfg.modules) or any(fnmatchcase(name, p) for p in cfg.exclude):
            continue
        out[name] = mod
    if not out:
        raise ValueError(f"{type(cfg).__name__} matches no uncompressed nn.Linear (modules={cfg.modules}, "
                         f"exclude={cfg.exclude}); check the patterns against model.named_modules()")
    return out


def _check_weights(targets: dict[str, nn.Linear]) -> None:
    for name, mod in targets.items():
        for pname, p in (("weight", mod.weight), ("bias", mod.bias)):
            if p is not None and not torch.isfinite(p).all():
                raise ValueError(f"{name}.{pname} holds NaN or inf values; compressing it would spread them. "
                                 "Reload the checkpoint (it may be corrupt) or exclude the module")


def _bias(mod: nn.Linear) -> torch.Tensor | None:
    return None if mod.bias is None else mod.bias.detach().clone()


def _record(model: nn.Module, cfg: Config) -> None:
    recipe = list(getattr(model, "compression_recipe", []))
    recipe.append(config_to_dict(cfg))
    model.compression_recipe = recipe


def _need_calibration(model: nn.Module, calibration: torch.Tensor | None, what: str) -> torch.Tensor:
    """`calibration` when it is what layer-wise calibration runs on: a LongTensor (N, T), N >= 1 and
    T >= 1, of token ids in the model's vocabulary (TypeError / ValueError naming it otherwise)."""
    fix = "pass calibration=quant.calibration_batches(tokenizer, ...)"
    if calibration is None:
        raise ValueError(f"{what} needs calibration windows: {fix}")
    if not isinstance(calibration, torch.Tensor):
        raise TypeError(f"calibration must be a LongTensor (N, T) of token ids, got {describe(calibration)}; {fix}")
    if calibration.dtype != torch.long or calibration.dim() != 2 or 0 in calibration.shape:
        raise ValueError(f"calibration must be a LongTensor (N, T) of token ids with N, T >= 1, got a "
                         f"{calibration.dtype} tensor of shape {tuple(calibration.shape)}; {fix}")
    check_data("calibration", calibration)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    low, high = int(calibration.min()), int(calibration.max())
    if low < 0 or (vocab is not None and high >= vocab):
        where = f"outside the model's vocabulary (0..{vocab - 1})" if vocab is not None else "not a token id"
        raise ValueError(f"calibration holds token id {low if low < 0 else high}, {where}; build it with the "
                         f"model's own tokenizer: {fix}")
    return calibration


def _check_bitsandbytes(cfg: Config, device: torch.device, dtype: torch.dtype) -> None:
    """Run the bitsandbytes op once on a tiny weight of this device and dtype; fail early with a clear error."""
    try:
        import bitsandbytes  # noqa: F401  (optional here: imported for the availability check)
    except ImportError as err:
        raise RuntimeError(f"{type(cfg).__name__} needs bitsandbytes: pip install bitsandbytes") from err
    probe = torch.ones(64, 128, dtype=dtype, device=device)  # (out, in)
    x = torch.ones(2, 128, dtype=dtype, device=device)
    try:
        if isinstance(cfg, NF4):
            NF4Linear.quantize(probe, None, cfg.blocksize, cfg.double_quant)(x)
        else:
            Int8MixedLinear.quantize(probe, None, cfg.threshold)(x)
    except (RuntimeError, NotImplementedError, ValueError, TypeError, AssertionError) as err:
        raise RuntimeError(f"bitsandbytes cannot run {cfg} on {device} with {dtype} weights ({type(err).__name__}: "
                           f"{err}); use Int4WeightOnly / Int8WeightOnly (PyTorch kernels) on this device") from err


Handler = Callable[[nn.Module, dict[str, nn.Linear], Config, "torch.Tensor | None", bool], None]
Preflight = Callable[[Config, dict[str, nn.Linear]], None]
# config type -> (a check that the format can run here, what replaces the selected linears): torchao's
# quantize_ handler table is the model; a new format is a config class and one `@handler(ConfigClass)`
_HANDLERS: dict[type[Config], tuple[Preflight | None, Handler]] = {}


def handler(config_type: type[Config], preflight: Preflight | None = None) -> Callable[[Handler], Handler]:
    """Register `fn(model, targets, config, calibration, progress)` as the handler of `config_type`;
    `preflight(config, targets)` runs first, before the weights are read."""
    def register(fn: Handler) -> Handler:
        _HANDLERS[config_type] = (preflight, fn)
        return fn
    return register


def _apply(model: nn.Module, config: Config, calibration: torch.Tensor | None, progress: bool) -> nn.Module:
    targets = select_linears(model, config)
    preflight, replace = _HANDLERS[type(config)]
    if preflight is not None:
        preflight(config, targets)
    _check_weights(targets)
    replace(model, targets, config, calibration, progress)
    _record(model, config)
    return model


@torch.no_grad()
def quantize_(model: nn.Module, config: Config, calibration: torch.Tensor | None = None,
              progress: bool = True) -> nn.Module:
    """Quantize the selected linears of `model` in place (and return it).

    config: Int8WeightOnly, Int4WeightOnly (method "rtn" or "gptq"), NF4 or Int8Mixed.
    calibration: LongTensor (N, T) windows (quant.calibration_batches), needed by GPTQ.
    """
    check_module("model", model, "a model to compress (runtime.load_model)")
    if isinstance(config, SemiStructured24):
        raise ValueError("SemiStructured24 is a sparsity config: use quant.sparsify_(model, config, ...)")
    if type(config) not in _HANDLERS:
        kinds = ", ".join(t.__name__ for t in _HANDLERS if t is not SemiStructured24)
        raise ValueError(f"quantize_ takes {kinds}, got {config!r}")
    return _apply(model, config, calibration, progress)


@torch.no_grad()
def sparsify_(model: nn.Module, config: SemiStructured24, calibration: torch.Tensor | None = None,
              progress: bool = True) -> nn.Module:
    """Prune the selected linears of `model` to 2:4 in place (and return it).

    method "magnitude" needs no calibration; "wanda" and "sparsegpt" need calibration windows.
    With `int4_group_size`, SparseGPT also quantizes the kept weights to INT4 (Sparse24Int4Linear).
    """
    check_module("model", model, "a model to compress (runtime.load_model)")
    if not isinstance(config, SemiStructured24):
        raise ValueError(f"sparsify_ takes a SemiStructured24 config, got {config!r}; quantize with quant.quantize_")
    return _apply(model, config, calibration, progress)


def _replace_each(model: nn.Module, targets: dict[str, nn.Linear], make: Callable[[nn.Linear], nn.Module]) -> None:
    for name, mod in targets.items():
        model.set_submodule(name, make(mod))


@handler(Int8WeightOnly)
def _int8_weight_only(model, targets, cfg: Int8WeightOnly, calibration, progress) -> None:
    _replace_each(model, targets, lambda mod: int8_rtn(mod.weight.detach(), _bias(mod)))


def _bitsandbytes_runs(cfg: Config, targets: dict[str, nn.Linear]) -> None:
    first = next(iter(targets.values())).weight
    _check_bitsandbytes(cfg, first.device, first.dtype)


@handler(NF4, preflight=_bitsandbytes_runs)
def _nf4(model, targets, cfg: NF4, calibration, progress) -> None:
    _replace_each(model, targets,
                  lambda mod: NF4Linear.quantize(mod.weight.detach(), _bias(mod), cfg.blocksize, cfg.double_quant))


@handler(Int8Mixed, preflight=_bitsandbytes_runs)
def _int8_mixed(model, targets, cfg: Int8Mixed, calibration, progress) -> None:
    _replace_each(model, targets, lambda mod: Int8MixedLinear.quantize(mod.weight.detach(), _bias(mod), cfg.threshold))


@handler(Int4WeightOnly)
def _int4_weight_only(model, targets, cfg: Int4WeightOnly, calibration, progress) -> None:
    for name, mod in targets.items():
        check_group_size(name, mod.in_features, cfg.group_size)
    if cfg.method != "gptq":
        _replace_each(model, targets, lambda mod: int4_rtn(mod.weight.detach(), cfg.group_size, _bias(mod), cfg.grid,
                                                           cfg.zero_point))
        return
    batches = _need_calibration(model, calibration, "Int4WeightOnly(method='gptq')")

    def gptq(name: str, mod: nn.Linear, stats) -> nn.Module:
        res = solve(mod.weight, stats.H, damp=cfg.damp, block_size=cfg.block_size, group_size=cfg.group_size,
                    act_order=cfg.act_order, grid=cfg.grid, zero_point=cfg.zero_point)
        return int4_module(res.codes, res.scales, res.zeros, cfg.group_size, _bias(mod), cfg.zero_point)

    compress_layerwise(model, batches, targets, "hessian", gptq, "gptq", progress=progress)


def _sparse_module(weight: torch.Tensor, drop: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> Sparse24Linear:
    """Sparse24Linear from a weight and its prune mask (exactly 2 dropped per group of 4)."""
    N, K = weight.shape
    keep_idx = torch.nonzero(~drop.view(N, K // 4, 4), as_tuple=True)[2].view(N, K // 4, 2)
    values = weight.view(N, K // 4, 4).gather(-1, keep_idx).reshape(N, K // 2).to(dtype)
    return Sparse24Linear(values, pack_24_indices(keep_idx), bias)


def _magnitude_24(mod: nn.Linear) -> Sparse24Linear:
    w = mod.weight.detach()
    return _sparse_module(w, mask_24(w.abs().float()), _bias(mod), w.dtype)


@handler(SemiStructured24)
def _semi_structured_24(model, targets, config: SemiStructured24, calibration, progress) -> None:
    for name, mod in targets.items():
        if mod.in_features % 8:
            raise ValueError(f"2:4 sparsity needs input widths divisible by 8; {name} has {mod.in_features}")
        if config.int4_group_size is not None:
            check_group_size(name, mod.in_features, config.int4_group_size)
    if config.method == "magnitude":
        _replace_each(model, targets, _magnitude_24)
    elif config.method == "wanda":
        batches = _need_calibration(model, calibration, "SemiStructured24(method='wanda')")

        def wanda(name: str, mod: nn.Linear, stats) -> nn.Module:
            w = mod.weight.detach()
            scores = w.abs().float() * stats.norms[None, :]
            return _sparse_module(w, mask_24(scores), _bias(mod), w.dtype)

        compress_layerwise(model, batches, targets, "norms", wanda, "wanda", progress=progress)
    else:
        batches = _need_calibration(model, calibration, "SemiStructured24(method='sparsegpt')")

        def sparsegpt(name: str, mod: nn.Linear, stats) -> nn.Module:
            w = mod.weight.detach()
            res = solve(w, stats.H, damp=config.damp, block_size=config.block_size,
                        group_size=config.int4_group_size, sparse24=True, grid="minmax")
            if config.int4_group_size is None:
                return _sparse_module(res.weight, res.drop, _bias(mod), w.dtype)
            N, K = w.shape
            keep_idx = torch.nonzero(~res.drop.view(N, K // 4, 4), as_tuple=True)[2].view(N, K // 4, 2)
            kept = res.codes.view(N, K // 4, 4).gather(-1, keep_idx).reshape(N, K // 2)
            return Sparse24Int4Linear(pack_int4(kept.to(torch.int32)), pack_24_indices(keep_idx),
                                      res.scales.to(torch.bfloat16).contiguous(),
                                      res.zeros.to(torch.bfloat16).contiguous(), config.int4_group_size, _bias(mod))

        compress_layerwise(model, batches, targets, "hessian", sparsegpt, "sparsegpt", progress=progress)
