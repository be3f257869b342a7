"""distill: offline training of drafts, one subpackage per method on one loop (`distill.trainer`).

`medusa` (Medusa-1 heads; `attach_medusa`, `save_medusa` and `load_medusa` re-exported from
specdec.drafters.medusa), `eagle` (EAGLE-3 heads, training-time test), `draft` (draft models,
DistillSpec's on-policy KD: `distill_draft`), `recover` (2:4-sparse models recovered by
distillation: `recover`); `data` holds what they train on (self-distillation answers, prompts, the
feature cache of Medusa and EAGLE-3), `command` their CLI subcommands.
"""

from distill.data.features import cache_eagle_states, cache_hidden_states
from distill.data.selfdistill import generate_selfdistill, read_records, sharegpt_prompts
from distill.draft.train import DistillConfig, distill_draft
from distill.eagle.train import EagleTrainConfig, train_eagle
from distill.medusa.train import MedusaTrainConfig, head_accuracy, train_medusa
from distill.recover.train import RecoverConfig, recover
from specdec.drafters.medusa.heads import attach_medusa, choose_tree
from specdec.drafters.medusa.io import load_medusa, read_medusa_config, save_medusa

__all__ = ["attach_medusa", "choose_tree", "load_medusa", "save_medusa", "read_medusa_config", "train_medusa",
           "MedusaTrainConfig", "cache_hidden_states", "head_accuracy", "generate_selfdistill",
           "read_records", "sharegpt_prompts", "train_eagle", "EagleTrainConfig", "cache_eagle_states",
           "recover", "RecoverConfig", "distill_draft", "DistillConfig"]
