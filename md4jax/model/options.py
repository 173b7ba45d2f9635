"""The denoiser network's architecture choices and their one check: the valid values of each
option (remat, norm, MLP, output init, adaLN activation, time conditioning, with the attention,
weight-init and time-feature choices of `md4jax.model.attention` and `md4jax.model.layers`) and
`check_network`, which `md4jax.model.transformer.Transformer` runs on its own fields and
`md4jax.config` on config.model."""

from typing import Callable

from md4jax.model.attention import ATTENTIONS
from md4jax.model.layers import TIME_FEATURES, WEIGHT_INITS

REMATS = ("none", "full", "save_dots")
NORMS = ("rms", "layer")  # RMSNorm with a learned scale; LayerNorm without scale or bias (MD4's).
MLPS = ("swiglu", "sigmoid_glu")  # Gate silu(x W_g) or sigmoid(x W_g), times x W_up.
# The logits layer: weight_init's plain-matrix init, or zeros (MD4's: uniform predictions at init).
OUTPUT_INITS = ("normal", "zeros")
ADALN_ACTIVATIONS = (
  "silu",
  "sigmoid",
)  # Applied to the time embedding before every adaLN projection.
TIME_CONDITIONINGS = ("none", "adaln")


def check_network(
  *,
  model_dim: int,
  num_heads: int,
  num_kv_heads: int = 0,
  time_conditioning: str = "none",
  attention: str = "xla",
  remat: str = "none",
  norm: str = "rms",
  mlp: str = "swiglu",
  output_init: str = "normal",
  weight_init: str = "normal",
  time_features: str = "dit",
  adaln_activation: str = "silu",
  time_dim: int = 0,
  embed_dim: int = 0,
  tie_embeddings: bool = False,
  lora_rank: int = 0,
  lora_alpha: float = 16.0,
  name: Callable[[str], str] = str,
):
  """Raises ValueError for a network no Transformer builds, naming each field as name(field):
  the one check of the architecture, which the Transformer runs on its own fields and the config
  validation on config.model (name: lambda k: f"model.{k}")."""

  def require(condition, message):
    if not condition:
      raise ValueError(message)

  for field, value, valid in (
    ("time_conditioning", time_conditioning, TIME_CONDITIONINGS),
    ("attention", attention, ATTENTIONS),
    ("remat", remat, REMATS),
    ("norm", norm, NORMS),
    ("mlp", mlp, MLPS),
    ("output_init", output_init, OUTPUT_INITS),
    ("weight_init", weight_init, WEIGHT_INITS),
    ("time_features", time_features, TIME_FEATURES),
    ("adaln_activation", adaln_activation, ADALN_ACTIVATIONS),
  ):
    require(value in valid, f"{name(field)}={value!r} is unknown; valid: {', '.join(valid)}.")
  require(
    model_dim % num_heads == 0 and (model_dim // num_heads) % 2 == 0,
    f"{name('model_dim')}={model_dim} / {name('num_heads')}={num_heads} must be an even "
    "integer head dim (RoPE rotates pairs).",
  )
  require(
    num_kv_heads >= 0 and num_heads % (num_kv_heads or num_heads) == 0,
    f"{name('num_kv_heads')}={num_kv_heads!r} must be 0 (= num_heads) or divide "
    f"{name('num_heads')}={num_heads}: each key/value head serves a whole group of query heads.",
  )
  require(
    time_features != "ddpm" or (time_dim or model_dim) >= 4,
    f"{name('time_features')}='ddpm' needs a time width >= 4 ({name('time_dim')}, 0: "
    f"model_dim), got {time_dim or model_dim}.",
  )
  require(
    not (tie_embeddings and embed_dim),
    f"{name('tie_embeddings')} reads the logits off the model_dim-wide embedding: set "
    f"{name('embed_dim')}=0.",
  )
  require(
    lora_rank >= 0,
    f"{name('lora_rank')}={lora_rank!r} must be >= 0 (the adapters' rank; 0: no LoRA).",
  )
  require(
    not lora_rank or lora_alpha > 0,
    f"{name('lora_alpha')}={lora_alpha!r} must be > 0 (the update is scaled by lora_alpha / "
    "lora_rank).",
  )
