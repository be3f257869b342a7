"""Triton kernels of the runtime: tiled flash attention over the static KV cache, flash-decoding.

The attention backend "triton" (`runtime.attention.attend`) calls `flash_attention`. The kernels
need a CUDA GPU, or the Triton interpreter (TRITON_INTERPRET=1 set before this package is
imported), which the CPU tests use.
"""

from runtime.kernels.flash_attention import (
    FlashConfig,
    default_config,
    flash_attention,
    flash_attention_ref,
    interpreted,
    visible_mask,
)
from runtime.kernels.flash_decoding import choose_num_splits, flash_merge, flash_merge_ref

__all__ = ["FlashConfig", "default_config", "flash_attention", "flash_attention_ref", "interpreted",
           "visible_mask", "choose_num_splits", "flash_merge", "flash_merge_ref"]
