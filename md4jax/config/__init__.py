"""The config tree and everything about it: its keys (`base_config`), the files that set them
(md4jax/configs/*.py, a workdir's config.json), model.preset's expansion, what a checkpoint
fixes, and validation.

A bad value fails before any compilation, with a message naming the key. The library
(diffusion, model, sampling, data, training, evaluation) never imports this package: the checks
of what a library function takes live with that function, and the validators here call them.
"""

from md4jax.config.base import base_config, fixed, fixed_keys
from md4jax.config.files import (
  CONFIG_DIR,
  config_names,
  config_path,
  from_saved,
  load_config,
  parse_flags,
  with_config_paths,
  workdir_config,
)
from md4jax.config.presets import PRESETS, expand_preset, md4_mlp_dim, preset_values
from md4jax.config.resume import check_resume, resume_changes
from md4jax.config.validation import validate_config
from md4jax.config.values import key_value, parse_list

__all__ = [
  "CONFIG_DIR",
  "PRESETS",
  "base_config",
  "check_resume",
  "config_names",
  "config_path",
  "expand_preset",
  "fixed",
  "fixed_keys",
  "from_saved",
  "key_value",
  "load_config",
  "md4_mlp_dim",
  "parse_flags",
  "parse_list",
  "preset_values",
  "resume_changes",
  "validate_config",
  "with_config_paths",
  "workdir_config",
]
