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

from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint, objective
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
  source_config: Optional[ml_collections.ConfigDict] = None,
  log=print,
) -> state_lib.TrainState:
  """Step 0 of a fresh run: the random init, or training.init_from's EMA params (sharded as
  the run's state). source_config: the init_from workdir's config, which the caller reads
  (config_lib.workdir_config; the training layer reads no config files)."""
  if not config.training.init_from:
    return state_lib.init_state(config, model, optimizer, mesh)
  path = config.training.init_from
  if source_config is None:
    raise ValueError(f"training.init_from={path!r}: pass its config (config_lib.workdir_config).")
  source = workdir_lib.as_workdir(path)
  target = state_lib.abstract_state(config, model, optimizer, mesh)
  source_model = state_lib.build_model(source_config)
  source_optimizer = state_lib.make_optimizer(source_config)
  abstract = state_lib.abstract_state(source_config, source_model, source_optimizer, mesh)
  wanted, held = _network_shapes(target.params), _network_shapes(abstract.params)
  if wanted != held:
    only = [f"{k} only in {'this run' if k in wanted else 'it'}" for k in set(wanted) ^ set(held)]
    differ = [
      f"{k} {held[k]} vs {wanted[k]}" for k in set(wanted) & set(held) if held[k] != wanted[k]
    ]
    raise ValueError(
      f"training.init_from={path!r}: its params do not fit this model (its shape vs this run's): "
      f"{'; '.join(sorted(differ + only)[:4])}. Keep its model keys (configs/adapt.py does)."
    )
  restored = checkpoint.restore_workdir(
    source, abstract, f"training.init_from={path!r}", lambda line: log(f"init_from: {line}")
  )
  params = objective.network_params(restored.state.ema_params)
  state = state_lib.state_from_params(config, optimizer, params)
  state = jax.device_put(state, state_lib.state_shardings(target))
  log(
    f"Starting from the EMA params of step {restored.step} in {source.checkpoints} "
    f"(training.init_from: model.type {source_config.model.type!r}, now {config.model.type!r})."
  )
  return state
