"""Rewards of rollouts, from post_train.reward's spec.

  "bigram:FILE.npy"   a [V, V] table R (NumPy .npy): a rollout x scores Σ_ℓ R[x_ℓ, x_ℓ+1] over
                      the pairs whose second token it generated (every pair, unprompted).
  "exact_match"       1 if the generated span, up to and including its first EOS, is the
                      example's response and its EOS token for token, else 0 (conditional data).
  "module:function"   any importable Python callable, function(rollouts) -> N rewards, called on
                      the host (on every process: it must be deterministic) between the
                      rollouts' program and the update's.

A reward reads the rollouts as a dict of [N, L] arrays (NumPy for a Python function): `tokens`
(int32), `generated` (bool: the span each rollout generated), `reference` and
`reference_editable` (its prompt's data row: the answer where editable). bigram and exact_match
are jax functions, computed inside the step's one program.

Every failure is a RewardError (a ValueError) in one line naming the spec and the problem.
"""

import importlib
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

ROLLOUT_FIELDS = ("tokens", "generated", "reference", "reference_editable")


class RewardError(ValueError):
  """A reward spec that cannot be used, or a reward function that failed or returned a bad value."""


class BigramReward:
  """Σ_ℓ R[x_ℓ, x_ℓ+1] of each row, traceable (in_program)."""

  in_program = True

  def __init__(self, table: np.ndarray, spec: str):
    self.table = np.asarray(table, np.float32)
    self.spec = spec

  def __call__(self, rollouts: dict) -> jax.Array:
    tokens = rollouts["tokens"]
    pairs = jnp.asarray(self.table)[tokens[:, :-1], tokens[:, 1:]]
    return jnp.where(rollouts["generated"][:, 1:], pairs, 0.0).sum(-1)


class ExactMatch:
  """1.0 where the generated span is the reference answer (its editable tokens), else 0.0."""

  in_program = True
  spec = "exact_match"

  def __call__(self, rollouts: dict) -> jax.Array:
    generated, answer = rollouts["generated"], rollouts["reference_editable"].astype(bool)
    same_tokens = (rollouts["tokens"] == rollouts["reference"]) | ~answer
    return ((generated == answer).all(-1) & same_tokens.all(-1)).astype(jnp.float32)


class CallableReward:
  """A Python function of the rollouts (NumPy arrays), run on the host; its output checked."""

  in_program = False

  def __init__(self, function: Callable, spec: str):
    self.function = function
    self.spec = spec

  def __call__(self, rollouts: dict) -> np.ndarray:
    arrays = {name: np.asarray(rollouts[name]) for name in ROLLOUT_FIELDS}
    rows = len(arrays["tokens"])
    try:
      values = self.function(arrays)
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
    if values.shape != (rows,):
      raise RewardError(
        f"post_train.reward={self.spec!r} returned {values.size} values for {rows} rollouts."
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
    raise RewardError(
      "post_train.reward is empty: give bigram:FILE.npy, exact_match or module:function."
    )
  if spec == "exact_match":
    return ExactMatch()
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
    raise RewardError(f"{where}: expected bigram:FILE.npy, exact_match or module:function.")
  try:
    module = importlib.import_module(kind)
  except ImportError as e:
    raise RewardError(f"{where}: cannot import {kind!r} ({e}).") from None
  function = getattr(module, rest, None)
  if not callable(function):
    raise RewardError(f"{where}: module {kind!r} has no callable {rest!r}.")
  return CallableReward(function, spec)
