"""Rewards of rollouts, from post_train.reward's spec.

  "bigram:FILE.npy"   a [V, V] table R (NumPy .npy): a rollout x scores Σ_ℓ R[x_ℓ, x_ℓ+1]. A jax
                      function, computed inside the step's one program.
  "module:function"   any importable Python callable, function(tokens [N, L] int32) -> N rewards,
                      called on the host between the rollouts' program and the update's.

Every failure is a RewardError (a ValueError) in one line naming the spec and the problem.
"""

import importlib
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


class RewardError(ValueError):
  """A reward spec that cannot be used, or a reward function that failed or returned a bad value."""


class BigramReward:
  """Σ_ℓ R[x_ℓ, x_ℓ+1] of each row, traceable (in_program)."""

  in_program = True

  def __init__(self, table: np.ndarray, spec: str):
    self.table = np.asarray(table, np.float32)
    self.spec = spec

  def __call__(self, tokens: jax.Array) -> jax.Array:
    table = jnp.asarray(self.table)
    return table[tokens[:, :-1], tokens[:, 1:]].sum(-1)


class CallableReward:
  """A Python function of the rollouts' token ids, run on the host; its output checked."""

  in_program = False

  def __init__(self, function: Callable, spec: str):
    self.function = function
    self.spec = spec

  def __call__(self, tokens: np.ndarray) -> np.ndarray:
    tokens = np.asarray(tokens, np.int32)
    try:
      values = self.function(tokens)
    except Exception as e:  # pylint: disable=broad-except  (any failure of the user's code)
      raise RewardError(
        f"post_train.reward={self.spec!r} raised {type(e).__name__}: {' '.join(str(e).split())}"
      ) from e
    try:
      values = np.asarray(values, np.float64).reshape(-1)
    except (TypeError, ValueError):
      raise RewardError(
        f"post_train.reward={self.spec!r} returned {type(values).__name__}, not numbers."
      ) from None
    if values.shape != (len(tokens),):
      raise RewardError(
        f"post_train.reward={self.spec!r} returned {values.size} values for {len(tokens)} rollouts."
      )
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
      raise RewardError(
        f"post_train.reward={self.spec!r} returned {values[bad[0]]} for rollout {bad[0]} "
        f"({bad.size} of {len(values)} not finite)."
      )
    return values.astype(np.float32)


def parse(spec: str, vocab_size: int):
  """The reward of post_train.reward's spec (the module docstring); RewardError if unusable."""
  where = f"post_train.reward={spec!r}"
  if not spec:
    raise RewardError("post_train.reward is empty: give bigram:FILE.npy or module:function.")
  kind, _, rest = spec.partition(":")
  if kind == "bigram":
    path = pathlib.Path(rest)
    if not path.is_file():
      raise RewardError(f"{where}: no file {path}.")
    try:
      table = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
      raise RewardError(f"{where}: {path} is not a .npy array ({e}).") from None
    if table.shape != (vocab_size, vocab_size):
      raise RewardError(
        f"{where}: the table is {list(table.shape)}, not [V, V] = [{vocab_size}, {vocab_size}]."
      )
    if not np.issubdtype(table.dtype, np.number) or not np.all(np.isfinite(table)):
      raise RewardError(f"{where}: the table holds a NaN, an infinity or no numbers.")
    return BigramReward(table, spec)
  if not rest or not kind:
    raise RewardError(f"{where}: expected bigram:FILE.npy or module:function.")
  try:
    module = importlib.import_module(kind)
  except ImportError as e:
    raise RewardError(f"{where}: cannot import {kind!r} ({e}).") from None
  function = getattr(module, rest, None)
  if not callable(function):
    raise RewardError(f"{where}: module {kind!r} has no callable {rest!r}.")
  return CallableReward(function, spec)
