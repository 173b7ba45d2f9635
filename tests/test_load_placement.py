"""md4jax.load of a Hugging Face folder places each param on the mesh as the config's sharding
rules lay it out (hf.folder_params with the mesh), never the whole model replicated on every
device: a float32 LLaDA-8B is 32 GB, which one device of a slice cannot hold."""

import pathlib

import jax
import numpy as np

from md4jax.app import hf as hf_lib
from md4jax.app import load
from md4jax.training import state as state_lib

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
MESH = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}  # The 8 test devices.


def test_a_loaded_folder_is_sharded_by_the_configs_rules_not_replicated():
  loaded = load.load(GOLDEN / "llada", overrides=MESH)
  assert dict(loaded.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  model, optimizer = state_lib.build_model(loaded.config), state_lib.make_optimizer(loaded.config)
  abstract = state_lib.abstract_state(loaded.config, model, optimizer, loaded.mesh)
  expected = jax.tree.map(lambda a: a.sharding, abstract.params)
  assert jax.tree.map(lambda a: a.sharding, loaded.params) == expected
  kernel = loaded.params["block_0"]["mlp"]["gate"]["kernel"]  # [D, mlp]: over fsdp and tensor.
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert not kernel.sharding.is_fully_replicated
  assert {shard.data.shape for shard in kernel.addressable_shards} == {(32, 48)}
  # A device holds a quarter of the kernel (fsdp × tensor), not all of it.
  assert kernel.addressable_shards[0].data.size * 4 == kernel.size
  # The same values as the folder's params read on the host.
  config, hf = hf_lib.folder_config(GOLDEN / "llada")
  host = hf_lib.folder_params(GOLDEN / "llada", config, hf)
  jax.tree.map(np.testing.assert_array_equal, host, jax.tree.map(np.asarray, loaded.params))
