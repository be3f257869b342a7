"""quant: offline compression. quantize_ / sparsify_ (INT8, INT4 RTN/GPTQ, NF4, LLM.int8, 2:4 magnitude /
Wanda / SparseGPT), calibration windows, compressed checkpoints, perplexity."""

from quant.api import quantize_, select_linears, sparsify_
from quant.calibration import calibration_batches, eval_batches, pack_windows
from quant.checkpoint import dir_nbytes, export_dense, model_nbytes, save_compressed
from quant.config import (
                          NF4,
                          Int4WeightOnly,
                          Int8Mixed,
                          Int8WeightOnly,
                          SemiStructured24,
                          config_from_dict,
                          config_to_dict,
)
from quant.perplexity import perplexity
from quant.recipe import Recipe, apply_recipe, load_recipe

__all__ = ["quantize_", "sparsify_", "select_linears", "calibration_batches", "eval_batches", "pack_windows",
           "save_compressed", "export_dense", "model_nbytes", "dir_nbytes", "Int8WeightOnly", "Int4WeightOnly",
           "NF4", "Int8Mixed", "SemiStructured24", "config_from_dict", "config_to_dict", "perplexity",
           "Recipe", "load_recipe", "apply_recipe"]
