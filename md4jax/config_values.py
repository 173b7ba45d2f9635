"""What a config's keys may hold: the valid choices, the values model.preset sets, and the
checks config validation is made of, each raising ValueError("Invalid config: ...") naming the
key (md4jax.config_validation runs them; md4jax.config_lib resolves presets).
"""

import functools

import ml_collections

DATASETS = ("markov", "text8", "localtext", "conditional", "lm1b", "owt")
TOKENIZERS = ("char", "byte", "bpe")
PACKINGS = ("concat", "documents")
MODEL_TYPES = ("mdm", "ar")
TIME_CONDITIONINGS = ("none", "adaln")
PRESETS = ("none", "md4")
LOSS_UNITS = ("nats", "bits")
DTYPES = ("float32", "bfloat16")
# text8: lowercase a-z and space, one id per character.
TEXT8_VOCAB_SIZE = 27


def key_value(config, name: str):
  """The value of a dotted key such as "eval.discrete_steps"."""
  return functools.reduce(getattr, name.split("."), config)


def parse_list(text: str, kind=int) -> tuple:
  """The comma-separated values of a config string, converted by `kind` ("" = none)."""
  return tuple(kind(part) for part in text.split(",") if part.strip())


OR_EMPTY = ' (or "" for none)'


def check_list(config, name: str, kind, allow_empty: bool, is_valid, what: str):
  """A comma-separated list key: parses, values valid and distinct."""
  text = key_value(config, name)
  try:
    values = parse_list(text, kind) if isinstance(text, str) else None
  except ValueError:
    values = None
  check(
    values is not None
    and (values or allow_empty)
    and all(map(is_valid, values))
    and len(set(values)) == len(values),
    f"{name} must be distinct {what} separated by commas{OR_EMPTY if allow_empty else ''}, "
    f"got {text!r}.",
  )
  return values


def parse_likelihood(text: str) -> tuple[str, int]:
  """eval.likelihood as (kind, orders): ("nelbo", 0), ("order", 1) (left to right) or
  ("orders", K) for "orders:K"; ValueError for anything else."""
  if text in ("nelbo", "order"):
    return text, int(text == "order")
  kind, _, count = str(text).partition(":")
  if kind == "orders" and count.isdigit() and int(count) > 0:
    return kind, int(count)
  raise ValueError(
    f'eval.likelihood must be "nelbo", "order" or "orders:K" (K >= 1), got {text!r}.'
  )


def check(condition: bool, message: str):
  """Raises ValueError("Invalid config: <message>") unless condition holds."""
  if not condition:
    raise ValueError(f"Invalid config: {message}")


def check_positive_int(config, name: str):
  """The dotted key `name` holds an int > 0 (a bool is not one)."""
  value = key_value(config, name)
  check(
    isinstance(value, int) and not isinstance(value, bool) and value > 0,
    f"{name} must be a positive integer, got {value!r}.",
  )


def check_choice(value, name: str, choices):
  """`value`, the value of the key `name`, is one of `choices`."""
  check(value in choices, f"{name}={value!r} is unknown; valid: {', '.join(choices)}.")


def md4_mlp_dim(model_dim: int) -> int:
  """MD4's MLP width for a model width D: 2/3 of 4 D, rounded up to a multiple of 32."""
  return -(-(8 * model_dim // 3) // 32) * 32


def preset_values(config: ml_collections.ConfigDict) -> dict:
  """{model key: value} that config.model.preset sets, for this config's widths ({} for "none").

  "md4": MD4's text network (google-deepmind/md4, md4/networks/transformer.py with
  md4/configs/md4/text8.py's choices), whose per-head width is also its token-embedding
  and time-embedding width.
  """
  model = config.model
  check_choice(model.preset, "model.preset", PRESETS)
  if model.preset == "none":
    return {}
  head_dim = model.model_dim // model.num_heads
  return {
    "time_conditioning": "adaln",
    "time_input": "t",
    "time_features": "ddpm",
    "time_dim": head_dim,
    "time_hidden_dim": 4 * head_dim,
    "adaln_activation": "sigmoid",
    "weight_init": "fan_in_mlp_depth",
    "norm": "layer",
    "norm_eps": 1e-5,
    "biases": True,
    "mlp": "sigmoid_glu",
    "mlp_dim": md4_mlp_dim(model.model_dim),
    "embed_dim": head_dim,
    "output_init": "zeros",
  }
