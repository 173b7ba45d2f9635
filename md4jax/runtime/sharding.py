"""Meshes and shardings: the one place that maps the model's logical axes to devices.

The mesh has three axes, sized by config.mesh (one of them may be -1: the rest
of the devices):

  data    data parallel: each device group holds whole params;
  fsdp    data parallel with params, optimizer state and EMA sharded on their
          model dimension (gathered for each use, ZeRO-3 style);
  tensor  tensor parallel: attention heads and MLP width split.

The model names the axes of its params and activations ("embed", "heads",
"mlp", ...); `LOGICAL_AXIS_RULES` maps those names to mesh axes. Every matrix
has an "embed" dimension, so FSDP shards every matrix. The batch is split over
data × fsdp. A single device is a mesh of shape (1, 1, 1): no code branches on
the device count.
"""

import contextlib
import math
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical axis -> mesh axis, first match whose mesh axis is still free in the
# array wins (so an activation's "embed" stays whole once "batch" took fsdp).
LOGICAL_AXIS_RULES = (
  ("batch", BATCH_AXES),
  ("embed", "fsdp"),  # The model width: params sharded by FSDP.
  ("heads", "tensor"),  # Attention heads: tensor parallel.
  ("mlp", "tensor"),  # MLP hidden width: tensor parallel.
  ("vocab", None),  # Vocabulary (50257 for GPT-2 divides nothing): whole.
  ("length", None),
  ("head_dim", None),
  ("qkv", None),
  ("modulation", None),  # adaLN shift/scale/gate outputs.
  ("time", None),  # Time-embedding features.
  ("layers", None),  # The stacked-layer axis of scanned blocks.
)


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, int, int]:
  """(data, fsdp, tensor) from config.mesh, a -1 entry taking the remaining devices."""
  sizes = [mesh_config[name] for name in MESH_AXES]
  if sum(size == -1 for size in sizes) > 1 or any(size == 0 or size < -1 for size in sizes):
    raise ValueError(
      f"Invalid config: mesh.data/fsdp/tensor = {tuple(sizes)}: each must be a "
      "positive integer, and at most one may be -1 (the remaining devices)."
    )
  known = math.prod(size for size in sizes if size != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(
        f"Invalid config: mesh {tuple(sizes)} cannot fill {num_devices} devices: "
        f"{num_devices} is not divisible by {known}."
      )
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(
      f"Invalid config: mesh.data × mesh.fsdp × mesh.tensor = "
      f"{' × '.join(map(str, sizes))} = {math.prod(sizes)}, but there are "
      f"{num_devices} devices; set one of them to -1 to use the rest."
    )
  return tuple(sizes)


def make_mesh(config, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """The (data, fsdp, tensor) mesh of config.mesh over `devices` (default: every device of
  every process), laid out along the physical topology where JAX knows it (TPU)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(config.mesh, len(devices))
  try:
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  except (ValueError, NotImplementedError, AssertionError):
    grid = np.asarray(devices).reshape(shape)  # No topology-aware layout for this shape.
  return Mesh(grid, MESH_AXES)


def logical_shardings(boxed_tree: Any, mesh: Mesh) -> Any:
  """NamedShardings of a pytree whose leaves may be flax LogicallyPartitioned boxes (the
  model's annotated params, and optimizer state and EMA built from them); others replicate."""
  specs = nn.get_partition_spec(boxed_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_AXIS_RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows over data × fsdp, the rest of each row whole."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


@contextlib.contextmanager
def activation_rules(mesh: Mesh):
  """Inside a traced function: the model's activation constraints take effect on `mesh`."""
  with (
    nn.logical_axis_rules(LOGICAL_AXIS_RULES),
    jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
  ):
    yield


def process_batch_shard(mesh: Mesh, num_rows: int) -> tuple[int, int]:
  """(index, count): this process's devices hold rows [index·n/count, (index+1)·n/count) of a
  batch of num_rows sharded by `batch_sharding`. Processes whose devices differ only along
  "tensor" hold the same rows."""
  indices = batch_sharding(mesh).addressable_devices_indices_map((num_rows,))
  starts = sorted({index[0].start or 0 for index in indices.values()})
  stops = sorted(
    {num_rows if index[0].stop is None else index[0].stop for index in indices.values()}
  )
  start, stop = starts[0], stops[-1]
  size = stop - start
  if num_rows % size or start % size or sum(b - a for a, b in zip(starts, stops)) != size:
    raise ValueError(
      f"The mesh gives this process rows that are not one contiguous block of a "
      f"{num_rows}-row batch: {sorted(zip(starts, stops))}."
    )
  return start // size, num_rows // size


def device_batch(batch: dict, mesh: Mesh) -> dict:
  """This process's rows (its `process_batch_shard`) as global arrays split over the batch axes."""
  sharding = batch_sharding(mesh)
  # With one row per batch shard, count is how many distinct row blocks the processes hold.
  _, count = process_batch_shard(mesh, mesh.shape["data"] * mesh.shape["fsdp"])

  def to_global(rows):
    rows = np.asarray(rows)
    return jax.make_array_from_process_local_data(
      sharding, rows, (rows.shape[0] * count,) + rows.shape[1:]
    )

  return jax.tree.map(to_global, batch)


def to_host(tree: Any) -> Any:
  """numpy copies of a pytree of (possibly multi-process) jax arrays, on every process."""

  def fetch(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(x)
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(fetch, tree)


def bytes_per_device(tree: Any) -> dict:
  """{device: bytes of the tree's shards it holds} for a pytree of jax arrays."""
  totals: dict = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
  return totals
