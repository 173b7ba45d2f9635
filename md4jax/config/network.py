"""The network's validators (config.model's architecture choices and the attention backend), for
`validate_config`, which runs them after the counts and the mesh."""

import ml_collections

from md4jax.config.values import check, check_choice
from md4jax.diffusion import bounds
from md4jax.model.options import check_network


def validate_network(model: ml_collections.ConfigDict):
  """The network's choices and widths: the Transformer's own check (`check_network`), and the
  types a config file may get wrong."""
  for name in ("biases", "scan_layers", "qkv_bias", "tie_embeddings"):
    check(
      isinstance(model[name], bool), f"model.{name} must be true or false, got {model[name]!r}."
    )
  for name in ("num_kv_heads", "time_dim", "time_hidden_dim", "embed_dim", "lora_rank"):
    check(
      type(model[name]) is int and model[name] >= 0,  # pylint: disable=unidiomatic-typecheck
      f"model.{name} must be an integer >= 0 (0: the default), got {model[name]!r}.",
    )
  check(
    isinstance(model.norm_eps, float) and model.norm_eps > 0,
    f"model.norm_eps must be a float > 0, got {model.norm_eps!r}.",
  )
  check(
    isinstance(model.rope_base, float) and model.rope_base > 0,
    f"model.rope_base must be a float > 0 (RoPE's θ), got {model.rope_base!r}.",
  )
  check(
    isinstance(model.lora_alpha, float) and model.lora_alpha > 0,
    f"model.lora_alpha must be a float > 0 (the LoRA update's scale is lora_alpha / lora_rank), "
    f"got {model.lora_alpha!r}.",
  )
  check_choice(model.time_input, "model.time_input", bounds.TIME_INPUTS)
  try:
    check_network(
      model_dim=model.model_dim,
      num_heads=model.num_heads,
      num_kv_heads=model.num_kv_heads,
      time_conditioning=model.time_conditioning,
      attention=model.attention,
      remat=model.remat,
      norm=model.norm,
      mlp=model.mlp,
      output_init=model.output_init,
      weight_init=model.weight_init,
      time_features=model.time_features,
      adaln_activation=model.adaln_activation,
      time_dim=model.time_dim,
      embed_dim=model.embed_dim,
      tie_embeddings=model.tie_embeddings,
      lora_rank=model.lora_rank,
      lora_alpha=model.lora_alpha,
      name=lambda field: f"model.{field}",
    )
  except ValueError as e:
    raise ValueError(f"Invalid config: {e}") from None


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
