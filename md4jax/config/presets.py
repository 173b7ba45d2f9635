"""model.preset: a named set of model keys and their values ("md4": MD4's text network,
docs/md4_parity.md), expanded into the config when it is loaded, so a workdir's config.json
shows every value.

A preset owns its keys. `expand_preset` sets each to the preset's value; a key something set
(the config file or a command-line override: base_config's keys remember it) to another value is
an error naming both. To vary one of them, set model.preset = "none" and every key of
`preset_values`.
"""

import copy
from typing import Iterable

import ml_collections

from md4jax.config.values import check, check_choice

PRESETS = ("none", "md4")


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


def _was_set(model: ml_collections.ConfigDict, key: str) -> bool:
  """Whether anything set model.<key> since base_config made it (True for a config built
  otherwise, whose keys keep no such record)."""
  return getattr(dict(model.items(preserve_field_references=True))[key], "was_set", True)


def expand_preset(
  config: ml_collections.ConfigDict, explicit: Iterable[str] = ()
) -> ml_collections.ConfigDict:
  """A copy of config with model.preset's values set (config itself for preset "none").

  explicit: the dotted keys the command line set. A key set (there, or by the config) to a value
  other than the preset's raises ValueError naming the key, both values and who set it.
  """
  values = preset_values(config)
  if not values:
    return config
  preset = config.model.preset
  check(
    config.model.type == "mdm",
    f"model.preset={preset!r} is a diffusion denoiser; model.type must be 'mdm', "
    f"got {config.model.type!r}.",
  )
  explicit, expanded = set(explicit), copy.deepcopy(config)
  for key, value in values.items():
    current = config.model[key]
    if current != value and (f"model.{key}" in explicit or _was_set(config.model, key)):
      who = (
        f"the command line sets --config.model.{key}={current!r}"
        if f"model.{key}" in explicit
        else f"the config sets model.{key}={current!r}"
      )
      check(
        False,
        f"model.preset={preset!r} sets model.{key}={value!r}, but {who}: a preset owns its "
        f"keys (drop model.{key}, or set it to {value!r}), or set model.preset='none' and every "
        "model key yourself.",
      )
    expanded.model[key] = value
    written = dict(expanded.model.items(preserve_field_references=True))[key]
    if hasattr(written, "was_set"):  # The preset's own value: nothing set it.
      written.was_set = False
  return expanded
