"""Adapting a trained model into a new run (AR → MDM, docs/adapt.md): its params as the start,
and the attention pattern annealed from causal to bidirectional.

training.init_from names a workdir (md4jax-trained or converted) whose newest checkpoint's EMA
params start a fresh run: step 0, a fresh optimizer state, the EMA at those params. Only the
network's param names and shapes must match; the model type, the data length and every other
key may differ (an ar model becomes an mdm one). A workdir that already holds checkpoints
resumes them instead.

training.attention_anneal_steps N > 0 anneals the attention as DiffuLLaMA does: at step s
(optimizer steps taken), query i reads key j ≤ i always and key j > i with probability
p = min(1, s / N), one Bernoulli draw per (i, j) and step, shared by the batch. Step 0 is causal
(the ar model's own pattern), every step from N on bidirectional, and evaluation and sampling
always bidirectional (the model the run ends with).
"""

from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from md4jax.training import objective
from md4jax.training import state as state_lib

# fold_in(the step's key, this): the annealed pattern's draws, apart from the loss's own.
_ANNEAL_STREAM = 0xA7713


def annealed_attention(key, step, config: ml_collections.ConfigDict) -> Optional[jax.Array]:
  """[L, L] bool (True = query i may read key j) of training step `step`, or None without
  annealing (training.attention_anneal_steps = 0): the network's own pattern, unchanged."""
  steps = config.training.attention_anneal_steps
  if not steps:
    return None
  length = config.data.seq_len
  share = jnp.minimum(1.0, jnp.asarray(step, jnp.float32) / steps)
  # u < p with u in [0, 1): never at p = 0, always at p = 1.
  future = jax.random.uniform(jax.random.fold_in(key, _ANNEAL_STREAM), (length, length)) < share
  return jnp.tril(jnp.ones((length, length), bool)) | future


def _network_shapes(params) -> dict:
  """{param path: shape} of the network's params (without a learned schedule's θ)."""
  flat = jax.tree_util.tree_flatten_with_path(objective.network_params(params))[0]
  return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in flat}


def initial_state(
  config: ml_collections.ConfigDict,
  model,
  optimizer,
  mesh: Mesh,
  init_params=None,
  origin: str = "",
  log=print,
  role: str = "training.init_from",
  path: str = "",
) -> state_lib.TrainState:
  """Step 0 of a fresh run: the random init, or init_params (the EMA params of the workdir `path`
  that the key `role` names, which the caller restores: md4jax.load) sharded as the run's
  state. origin: where they came from, for the log line."""
  if init_params is None:
    return state_lib.init_state(config, model, optimizer, mesh)
  target = state_lib.abstract_state(config, model, optimizer, mesh)
  wanted, held = _network_shapes(target.params), _network_shapes(init_params)
  if wanted != held:
    only = [f"{k} only in {'this run' if k in wanted else 'it'}" for k in set(wanted) ^ set(held)]
    differ = [
      f"{k} {held[k]} vs {wanted[k]}" for k in set(wanted) & set(held) if held[k] != wanted[k]
    ]
    raise ValueError(
      f"{role}={path!r}: its params do not fit this model (its "
      f"shape vs this run's): {'; '.join(sorted(differ + only)[:4])}. Keep its model keys "
      "(configs/adapt.py does)."
    )
  params = objective.network_params(init_params)
  state = state_lib.state_from_params(config, optimizer, params)
  state = jax.device_put(state, state_lib.state_shardings(target))
  log(f"Starting from the EMA params of {origin} ({role}).")
  return state
