"""ModelConfig: the frozen description of a Llama-family model, built from a Hugging Face config."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# Most positions a config may declare: the rotary tables are built for all of them (2**20 covers
# the longest-context Llama / Qwen2 releases, 1M tokens), so a typo such as 10**12 fails here
# instead of asking for terabytes when the model first runs.
MAX_POSITIONS = 1 << 20
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
          "head_dim", "max_position_embeddings")
# the Hugging Face config keys from_hf reads sizes from
HF_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings")


def check_model_type(model_type: Any) -> None:
    """UnsupportedModelError unless `model_type` is a family the runtime implements."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not implemented by the specdec runtime (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}). Load it with transformers "
            "(AutoModelForCausalLM.from_pretrained) and pass that model to specdec.generate: "
            "runtime.HFAdapter wraps any PreTrainedModel (a slower path).")


def is_size(value: Any) -> bool:
    """Whether `value` is an integer >= 1 (a bool is not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of one Llama / Qwen2 / Mistral-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"
    hf_config: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in _SIZES:
            value = getattr(self, name)
            if not is_size(value):
                raise ValueError(f"ModelConfig.{name} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ValueError(f"ModelConfig.max_position_embeddings is {self.max_position_embeddings}, more than "
                             f"the {MAX_POSITIONS} (2**20) positions the runtime supports (its rotary tables "
                             "hold every position); lower it to the context the model was trained for")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads}) for grouped-query attention")

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Build from a `transformers` config; raises UnsupportedModelError for other families and
        ValueError for sizes that are not positive integers."""
        model_type = getattr(hf_config, "model_type", None)
        check_model_type(model_type)
        for key in HF_SIZE_KEYS:  # before any arithmetic on them (hidden_size // 0 ...)
            value = getattr(hf_config, key, None)
            if not is_size(value):
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        if model_type == "qwen2":
            qkv_bias = True
            window = hf_config.sliding_window if getattr(hf_config, "use_sliding_window", False) else None
        else:
            qkv_bias = bool(getattr(hf_config, "attention_bias", False))
            window = getattr(hf_config, "sliding_window", None) if model_type == "mistral" else None
        if getattr(hf_config, "mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=True is not implemented by the specdec runtime; "
                                        "use runtime.HFAdapter for this checkpoint")
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf_config.max_position_embeddings,
            rms_norm_eps=hf_config.rms_norm_eps,
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            sliding_window=window,
            model_type=model_type,
            hf_config=hf_config,
        )

    @property
    def qkv_size(self) -> int:
        """Output width of the fused q/k/v projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
