"""Checkpoints are layout-free: a state saved under one mesh restores under another and continues
exactly as the uninterrupted run."""

import chex
import jax
import pytest

from md4jax import config as config_lib
from md4jax.data import sources
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint, train
from md4jax.training import state as state_lib


def _config(data_axis=-1, fsdp=1, tensor=1):
  config = config_lib.load_config("tiny")
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data_axis, fsdp, tensor
  return config


def _steps(config, mesh, state, start: int, num: int):
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  step_fn = train.make_train_step(config, model, optimizer, mesh, state)
  iterator = sources.make_source(config).train_iterator()
  iterator.set_state({"next_batch_index": start})
  for _ in range(num):
    state, _ = step_fn(state, sharding.device_batch(next(iterator), mesh))
  return state


@pytest.fixture(scope="module")
def saved_under_fsdp(tmp_path_factory):
  """A step-2 checkpoint saved under fsdp 8, and the state 2 steps later."""
  workdir = tmp_path_factory.mktemp("fsdp")
  config = _config(data_axis=1, fsdp=8)
  mesh = sharding.make_mesh(config)
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  state = _steps(config, mesh, state_lib.init_state(config, model, optimizer, mesh), 0, 2)
  manager = checkpoint.make_manager(workdir_lib.as_workdir(workdir).checkpoints, 3)
  checkpoint.save(manager, 2, state, {"next_batch_index": 2}, config)
  manager.wait_until_finished()
  return workdir, jax.device_get(_steps(config, mesh, state, 2, 2))


@pytest.mark.parametrize("layout", [dict(devices=1), dict(data_axis=2, fsdp=2, tensor=2)])
def test_fsdp_checkpoint_restores_on_other_meshes_and_continues(saved_under_fsdp, layout):
  workdir, expected = saved_under_fsdp
  devices = jax.devices()[: layout.pop("devices", 8)]
  config = _config(**layout)
  mesh = sharding.make_mesh(config, devices)
  abstract = state_lib.abstract_state(
    config, state_lib.build_model(config), state_lib.make_optimizer(config), mesh
  )
  restored = checkpoint.restore(
    checkpoint.make_manager(workdir_lib.as_workdir(workdir).checkpoints, 3), abstract
  )
  step, state = restored.step, restored.state
  assert step == 2 and restored.data_state == {"next_batch_index": 2}
  assert (
    state.params["block_0"]["mlp"]["gate"]["kernel"].sharding
    == abstract.params["block_0"]["mlp"]["gate"]["kernel"].sharding
  )
  final = _steps(config, mesh, state, 2, 2)
  chex.assert_trees_all_close(jax.device_get(final), expected, rtol=1e-5, atol=1e-7)
