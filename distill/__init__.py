"""distill: offline training of drafts. Medusa heads (self-distillation data, training; `attach_medusa`,
`save_medusa` and `load_medusa` re-exported from specdec.drafters.medusa), EAGLE-3 heads (feature
cache, training-time-test training) and draft models (`distill_draft`, DistillSpec's on-policy KD);
recovery of 2:4-sparse models by distillation (`recover`)."""

from distill.draft import DistillConfig, distill_draft
from distill.eagle_cache import cache_eagle_states
from distill.recover import RecoverConfig, recover
from distill.selfdistill import generate_selfdistill, read_records, sharegpt_prompts
from distill.train_eagle import EagleTrainConfig, train_eagle
from distill.train_medusa import MedusaTrainConfig, cache_hidden_states, head_accuracy, train_medusa
from specdec.drafters.medusa.heads import attach_medusa, choose_tree
from specdec.drafters.medusa.io import load_medusa, read_medusa_config, save_medusa

__all__ = ["attach_medusa", "choose_tree", "load_medusa", "save_medusa", "read_medusa_config", "train_medusa",
           "MedusaTrainConfig", "cache_hidden_states", "head_accuracy", "generate_selfdistill",
           "read_records", "sharegpt_prompts", "train_eagle", "EagleTrainConfig", "cache_eagle_states",
           "recover", "RecoverConfig", "distill_draft", "DistillConfig"]
