"""The network's validators (config.model's architecture choices and the attention backend), for
`validate_config`, which runs them after the counts and the mesh."""

import ml_collections

from md4jax.config_values import check, check_choice
from md4jax.diffusion import bounds
from md4jax.model import transformer as model_lib


def validate_network(model: ml_collections.ConfigDict):
  """The network's choices (md4jax.model.transformer) and its optional widths."""
  check_choice(model.attention, "model.attention", model_lib.ATTENTIONS)
  check_choice(model.remat, "model.remat", model_lib.REMATS)
  check_choice(model.norm, "model.norm", model_lib.NORMS)
  check_choice(model.mlp, "model.mlp", model_lib.MLPS)
  check_choice(model.output_init, "model.output_init", model_lib.OUTPUT_INITS)
  check_choice(model.weight_init, "model.weight_init", model_lib.WEIGHT_INITS)
  check_choice(model.time_input, "model.time_input", bounds.TIME_INPUTS)
  check_choice(model.time_features, "model.time_features", model_lib.TIME_FEATURES)
  check_choice(model.adaln_activation, "model.adaln_activation", model_lib.ADALN_ACTIVATIONS)
  check(
    isinstance(model.norm_eps, float) and model.norm_eps > 0,
    f"model.norm_eps must be a float > 0, got {model.norm_eps!r}.",
  )
  for name in ("biases", "scan_layers", "qkv_bias", "tie_embeddings"):
    check(
      isinstance(model[name], bool), f"model.{name} must be true or false, got {model[name]!r}."
    )
  kv_heads = model.num_kv_heads
  check(
    type(kv_heads) is int and kv_heads >= 0 and model.num_heads % (kv_heads or 1) == 0,  # pylint: disable=unidiomatic-typecheck
    f"model.num_kv_heads={kv_heads!r} must be 0 (= num_heads) or divide model.num_heads="
    f"{model.num_heads}: each key/value head serves a whole group of query heads.",
  )
  check(
    not (model.tie_embeddings and model.embed_dim),
    "model.tie_embeddings reads the logits off the model_dim-wide embedding: set model.embed_dim=0.",
  )
  check(
    isinstance(model.rope_base, float) and model.rope_base > 0,
    f"model.rope_base must be a float > 0 (RoPE's θ), got {model.rope_base!r}.",
  )
  for name in ("time_dim", "time_hidden_dim"):
    check(
      type(model[name]) is int and model[name] >= 0,  # pylint: disable=unidiomatic-typecheck
      f"model.{name} must be an integer >= 0 (0: the default width), got {model[name]!r}.",
    )
  check(
    model.time_features != "ddpm" or (model.time_dim or model.model_dim) >= 4,
    f"model.time_features='ddpm' needs a time width (model.time_dim, 0: model_dim) >= 4, "
    f"got {model.time_dim or model.model_dim}.",
  )
  check(
    type(model.embed_dim) is int and model.embed_dim >= 0,  # pylint: disable=unidiomatic-typecheck
    f"model.embed_dim must be an integer >= 0 (0: model_dim), got {model.embed_dim!r}.",
  )


def validate_attention(config: ml_collections.ConfigDict, platform: str):
  """The attention backend runs on this platform, with this dtype and these shapes."""
  model = config.model
  head_dim = model.model_dim // model.num_heads
  if model.attention == "cudnn":
    check(
      platform in ("gpu", "cuda"),
      f"model.attention='cudnn' runs on NVIDIA GPUs only; this run's devices are {platform!r}: "
      "use 'xla'.",
    )
    check(
      model.dtype == "bfloat16",
      f"model.attention='cudnn' (flash attention) needs model.dtype='bfloat16', got {model.dtype!r}.",
    )
    check(
      head_dim % 8 == 0 and head_dim <= 128,
      f"model.attention='cudnn' needs a head dim (model_dim / num_heads) that is a multiple of 8 "
      f"and at most 128, got {head_dim}.",
    )
  if model.attention == "splash":
    check(
      platform == "tpu",
      f"model.attention='splash' is a TPU kernel; this run's devices are {platform!r}: use 'xla'.",
    )
    check(
      config.data.seq_len % 128 == 0,
      f"model.attention='splash' needs data.seq_len divisible by 128, got {config.data.seq_len}.",
    )
