"""Meshes from config, logical-axis rules, process shards of the batch, host copies."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax.data import sources
from md4jax.runtime import sharding
from md4jax.training import state as state_lib


def _mesh_config(data_axis, fsdp, tensor):
  return ml_collections.ConfigDict({"data": data_axis, "fsdp": fsdp, "tensor": tensor})


@pytest.mark.parametrize(
  "sizes, expected",
  [
    ((-1, 1, 1), (8, 1, 1)),
    ((1, -1, 1), (1, 8, 1)),
    ((2, -1, 2), (2, 2, 2)),
    ((2, 2, 2), (2, 2, 2)),
    ((-1, 4, 1), (2, 4, 1)),
  ],
)
def test_mesh_shape_fills_the_devices(sizes, expected):
  assert sharding.mesh_shape(_mesh_config(*sizes), 8) == expected


def test_make_mesh_names_its_axes_and_uses_every_device():
  config = config_lib.load_config("tiny")
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, -1, 2
  mesh = sharding.make_mesh(config)
  assert mesh.axis_names == sharding.MESH_AXES and dict(mesh.shape) == {
    "data": 2,
    "fsdp": 2,
    "tensor": 2,
  }
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
  assert sharding.make_mesh(config_lib.load_config("tiny"), jax.devices()[:1]).devices.shape == (
    1,
    1,
    1,
  )


def test_every_logical_axis_of_the_model_has_a_rule():
  config = config_lib.load_config("tiny")
  config.model.time_conditioning, config.model.scan_layers = "adaln", True
  model = state_lib.build_model(config)
  boxed = jax.eval_shape(
    lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32), jnp.ones((1,)))
  )["params"]
  names = {
    name
    for box in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    for name in box.names
  }
  assert names <= {logical for logical, _ in sharding.LOGICAL_AXIS_RULES}, names


def test_activations_are_constrained_to_the_batch_axes():
  config = config_lib.load_config("tiny")
  config.mesh.data, config.mesh.fsdp = 1, -1
  mesh = sharding.make_mesh(config)
  model = state_lib.build_model(config)
  params = state_lib.init_state(config, model, state_lib.make_optimizer(config), mesh).params
  tokens = jax.device_put(jnp.zeros((8, 16), jnp.int32), sharding.batch_sharding(mesh))

  def apply(params, tokens):
    with sharding.activation_rules(mesh):
      return model.apply({"params": params}, tokens)

  text = jax.jit(apply).lower(params, tokens).as_text()
  assert "sharding_constraint" in text and '"fsdp"' in text
  logits = jax.jit(apply)(params, tokens)
  assert logits.sharding.shard_shape(logits.shape) == (
    1,
    16,
    8,
  )  # Rows split 8 ways, the rest whole.


def test_one_process_holds_the_whole_batch_and_device_batch_splits_it():
  config = config_lib.load_config("tiny")
  mesh = sharding.make_mesh(config)
  assert sharding.process_batch_shard(mesh, 16) == (0, 1)
  batch = sources.make_source(config).batch(0)
  arrays = sharding.device_batch(batch, mesh)
  assert arrays["tokens"].shape == (16, 16) and len(arrays["tokens"].sharding.device_set) == 8
  host = sharding.to_host(arrays)
  for name, value in batch.items():
    np.testing.assert_array_equal(host[name], value)


def test_bytes_per_device_counts_each_shard():
  config = config_lib.load_config("tiny")
  mesh = sharding.make_mesh(config)
  x = jax.device_put(jnp.zeros((8, 4), jnp.float32), sharding.batch_sharding(mesh))
  assert set(sharding.bytes_per_device({"x": x}).values()) == {16}
