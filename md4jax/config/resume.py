"""Resuming a workdir with another config: the keys base_config declares fixed(...) decide what a
checkpoint holds, so a resumed run may not change them; every other key may change."""

import functools

import ml_collections

from md4jax.config.base import fixed_keys
from md4jax.config.values import key_value
from md4jax.diffusion import schedules


def resume_changes(saved: dict, config: ml_collections.ConfigDict) -> list[str]:
  """ "key: old → new" for each fixed key whose value differs from the saved config's."""
  changes = []
  saved_value = lambda name: functools.reduce(
    lambda d, k: d.get(k, {}) if isinstance(d, dict) else {}, name.split("."), saved
  )
  for name in fixed_keys():
    old = saved_value(name)
    new = key_value(config, name)
    if name == "data.vocab_size" and new == 0:
      continue  # 0: the tokenizer's size, which the run checks against the saved tokenizer.
    if old != {} and old != new:  # {}: a key older checkpoints did not have.
      changes.append(f"{name}: {old!r} → {new!r}")
  # A learned schedule's θ is in the checkpoint: switching to, from or between them changes it.
  old, new = saved_value("diffusion.schedule"), config.diffusion.schedule
  if old not in ({}, new) and {old, new} & set(schedules.LEARNED_NAMES):
    changes.append(f"diffusion.schedule: {old!r} → {new!r}")
  return changes


def check_resume(saved: dict, config: ml_collections.ConfigDict, where):
  """Raises ValueError naming every key whose change the checkpoints in `where` cannot follow."""
  changes = resume_changes(saved, config)
  if changes:
    raise ValueError(
      f"Cannot resume from the checkpoints in {where}: this config changes what they hold "
      f"({'; '.join(changes)}). Run with the old values, or use a new --workdir. Keys that "
      "may change on resume: steps, logging, eval, sample, batch size, optimizer, training, "
      "mesh, model.dtype/remat/attention, diffusion.schedule (between mask-rate schedules)."
    )
