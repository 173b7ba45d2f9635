"""Orbax checkpoints: one folder per step in the workdir's checkpoints/, holding the
train state, the data-iterator state and the config.

Saves are asynchronous: `save` returns once the arrays are copied to host and
the files are written in the background; call `manager.wait_until_finished()`
before the process exits. A step folder appears under its final name only when
it is complete (orbax writes to a temporary folder and renames it).
"""

import json
from typing import Any, Optional

import jax
import ml_collections
import orbax.checkpoint as ocp

from md4jax import workdir as workdir_lib


def make_manager(workdir, max_to_keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True,
                                         create=True)
  return ocp.CheckpointManager(workdir_lib.as_workdir(workdir).checkpoints.absolute(), options=options,
                               item_names=("state", "data", "config"))


def save(manager: ocp.CheckpointManager, step: int, state: Any, data_state: dict,
         config: ml_collections.ConfigDict):
  """Starts an asynchronous save of `state`, `data_state` and `config` at `step`."""
  manager.save(step, force=True, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave(data_state),
      config=ocp.args.JsonSave(json.loads(config.to_json_best_effort()))))


def restore(manager: ocp.CheckpointManager, abstract_state: Any,
            step: Optional[int] = None) -> Optional[tuple[int, Any, dict]]:
  """(step, state, data_state) of checkpoint `step` (default: the latest), or None if there is none.

  `abstract_state` is a pytree of jax.ShapeDtypeStruct with shardings: arrays are
  restored straight onto those devices.
  """
  step = manager.latest_step() if step is None else step
  if step is None:
    return None
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      data=ocp.args.JsonRestore()))
  return step, restored["state"], restored["data"]


def abstract_like(tree: Any) -> Any:
  """Shapes, dtypes and shardings of a pytree of arrays, without their data."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
