"""Building a run: optimizer masks and schedule, and a state created sharded by the logical rules."""

import jax
import jax.numpy as jnp
import numpy as np

from md4jax import config as config_lib
from md4jax.runtime import sharding
from md4jax.training import state as state_lib


def load_config(name):
  config = config_lib.load_config(name)
  config.lock()
  return config


def test_weight_decay_skips_norms_and_vectors():
  config = load_config("tiny")
  params = state_lib.init_state(
    config,
    state_lib.build_model(config),
    state_lib.make_optimizer(config),
    sharding.make_mesh(config, jax.devices()[:1]),
  ).params
  mask = state_lib.weight_decay_mask(params)
  assert mask["block_0"]["attn"]["qkv"]["kernel"] and mask["embed"]["embedding"]
  assert not mask["final_norm"]["scale"] and not mask["block_0"]["attn_norm"]["scale"]


def test_learning_rate_warms_up_then_decays_to_zero():
  config = load_config("tiny")
  schedule = state_lib.learning_rate_schedule(config)
  peak, warmup = config.optimizer.learning_rate, config.optimizer.warmup_steps
  assert schedule(0) == 0.0
  np.testing.assert_allclose(schedule(warmup), peak, rtol=1e-6)
  np.testing.assert_allclose(schedule(config.num_train_steps), 0.0, atol=1e-9)


def _bytes_per_device(config, devices):
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = state_lib.init_state(config, model, optimizer, sharding.make_mesh(config, devices))
  return {
    name: max(sharding.bytes_per_device(getattr(state, name)).values())
    for name in ("params", "opt_state", "ema_params")
  }


def test_fsdp_shards_params_optimizer_state_and_ema():
  config = load_config("tiny")
  config.mesh.data, config.mesh.fsdp = 1, -1
  whole = _bytes_per_device(config, jax.devices()[:1])
  sharded = _bytes_per_device(config, jax.devices())
  # Every matrix and norm scale has an "embed" axis, sharded 8 ways; Adam's step count is whole.
  assert (
    sharded["params"] * 8 == whole["params"] and sharded["ema_params"] * 8 == whole["ema_params"]
  )
  assert sharded["opt_state"] * 8 <= whole["opt_state"] + 8 * 64


def test_state_leaves_get_their_logical_shardings():
  config = load_config("tiny")
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  mesh = sharding.make_mesh(config)
  abstract = state_lib.abstract_state(
    config, state_lib.build_model(config), state_lib.make_optimizer(config), mesh
  )
  spec = lambda leaf: tuple(leaf.sharding.spec)
  attention = abstract.params["block_0"]["attn"]
  assert spec(attention["qkv"]["kernel"]) == ("fsdp", None, "tensor", None)
  assert spec(attention["out"]["kernel"]) == ("tensor", None, "fsdp")
  assert spec(abstract.params["block_0"]["mlp"]["gate"]["kernel"]) == ("fsdp", "tensor")
  assert spec(abstract.params["block_0"]["mlp"]["down"]["kernel"]) == ("tensor", "fsdp")
  assert spec(abstract.params["embed"]["embedding"]) == (None, "fsdp")
  assert spec(abstract.params["logits"]["kernel"]) == ("fsdp", None)
  # Adam's moments and the EMA are laid out like the params they follow.
  adam = abstract.opt_state[1][0]
  assert spec(adam.mu["block_0"]["attn"]["qkv"]["kernel"]) == ("fsdp", None, "tensor", None)
  assert spec(abstract.ema_params["block_0"]["mlp"]["up"]["kernel"]) == ("fsdp", "tensor")
  assert abstract.step.sharding.spec == jax.sharding.PartitionSpec()


def test_bfloat16_compute_keeps_float32_params_and_optimizer_state():
  config = load_config("tiny")
  config.model.dtype = "bfloat16"
  abstract = state_lib.abstract_state(
    config,
    state_lib.build_model(config),
    state_lib.make_optimizer(config),
    sharding.make_mesh(config, jax.devices()[:1]),
  )
  floats = [
    leaf.dtype
    for leaf in jax.tree.leaves((abstract.params, abstract.opt_state, abstract.ema_params))
    if jnp.issubdtype(leaf.dtype, jnp.floating)
  ]
  assert floats and all(dtype == jnp.float32 for dtype in floats)
