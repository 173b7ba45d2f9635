"""Orbax checkpoints: one folder per step in a run's checkpoints folder (its workdir's
checkpoints/), holding the train state, the data-iterator state, the training loop's unlogged
metrics and the config.

Saves are asynchronous: `save` returns once the arrays are copied to host and
the files are written in the background; `wait` blocks until they are on disk
(and turns a failed write into a clear error). A step folder appears under its
final name only when it is complete (orbax writes to a temporary folder and
renames it), so a crash mid-save leaves the previous checkpoints intact.

`restore` takes the newest checkpoint that reads back: an unreadable one
(truncated or missing files, garbage metadata) is reported, moved aside as
`<step>.unreadable` so training can save that step again, and never deleted.

A run's first checkpoint may hold its params alone (`save_start`, what md4jax.convert writes):
a `params` item in place of `state`, with the state's step, params and rng. Its EMA is its
params and its optimizer state fresh (every moment and count zero), so neither is written:
`restore` builds both on the devices it restores onto. A converted model's checkpoint is then
a quarter of a full one, and writing it never holds more than the params.
"""

import dataclasses
import errno
import json
import pathlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

ITEMS = ("state", "params", "data", "loop", "config")
# A start's item (`save_start`): {"step", "params", "rng"} of a state whose EMA is its params
# and whose optimizer state is all zeros.
START_ITEM = "params"
UNREADABLE_SUFFIX = ".unreadable"
# A start is written this many GB at a time (copied off the devices, written, then the next):
# the host never holds a second copy of the params.
_START_SAVE_GB = 0.25


class CheckpointError(RuntimeError):
  """No checkpoint can be read, or one cannot be written."""


@dataclasses.dataclass
class Restored:
  step: int
  state: Any
  data_state: dict  # The data iterator's state.
  loop_state: (
    dict  # {"window": the training loop's metrics since its last log ([] for older checkpoints)}.
  )


def make_manager(
  directory, max_to_keep: int, keep_period: Optional[int] = None
) -> ocp.CheckpointManager:
  """The manager of the checkpoints folder `directory` (created by the first save); a step that
  keep_period divides is never deleted (distillation's round ends: the next round's teacher)."""
  options = ocp.CheckpointManagerOptions(
    max_to_keep=max_to_keep,
    keep_period=keep_period,
    enable_async_checkpointing=True,
    create=True,
  )
  return ocp.CheckpointManager(
    pathlib.Path(directory).absolute(), options=options, item_names=ITEMS
  )


def save(
  manager: ocp.CheckpointManager,
  step: int,
  state: Any,
  data_state: dict,
  config: ml_collections.ConfigDict,
  loop_state: Optional[dict] = None,
):
  """Starts an asynchronous save at `step`; raises CheckpointError if an earlier save failed."""
  try:
    manager.save(
      step,
      force=True,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        loop=ocp.args.JsonSave(loop_state or {}),
        config=ocp.args.JsonSave(json.loads(config.to_json_best_effort())),
      ),
    )
  except Exception as e:  # pylint: disable=broad-except  (orbax wraps the OSError)
    raise _write_error(manager, step, e) from e


def wait(manager: ocp.CheckpointManager):
  """Blocks until pending saves are on disk; a failed write becomes a CheckpointError."""
  try:
    manager.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    raise _write_error(manager, None, e) from e


def save_start(
  directory,
  step: int,
  start: dict,
  data_state: dict,
  config: ml_collections.ConfigDict,
  max_to_keep: int,
):
  """Writes checkpoint `step` of a run's start into the checkpoints folder `directory` and waits
  for it: `start` is {"step", "params", "rng"} (jax arrays) of a state whose EMA is its params
  and whose optimizer state is fresh, all zeros (the caller checks that its optimizer's is):
  `restore` builds both. Written a slice at a time (_START_SAVE_GB), so the host never holds a
  second copy of the params. CheckpointError if the write fails."""
  options = ocp.CheckpointManagerOptions(
    max_to_keep=max_to_keep, enable_async_checkpointing=True, create=True
  )
  manager = ocp.CheckpointManager(
    pathlib.Path(directory).absolute(),
    options=options,
    item_names=ITEMS,
    item_handlers={START_ITEM: _sliced_handler()},
  )
  try:
    manager.save(
      step,
      force=True,
      args=ocp.args.Composite(
        **{START_ITEM: ocp.args.PyTreeSave(start)},
        data=ocp.args.JsonSave(data_state),
        loop=ocp.args.JsonSave({}),
        config=ocp.args.JsonSave(json.loads(config.to_json_best_effort())),
      ),
    )
  except Exception as e:  # pylint: disable=broad-except  (orbax wraps the OSError)
    raise _write_error(manager, step, e) from e
  wait(manager)
  manager.close()


def _sliced_handler() -> ocp.PyTreeCheckpointHandler:
  """A handler that copies arrays off their devices _START_SAVE_GB at a time, each slice written
  before the next is copied (orbax's default copies every array first: a second copy of the
  params on the host). Orbax schedules those slices for arrays whose transfer priority is
  "deprioritized", which only its array handler's status callback says; the callback's types
  are not exported, so an orbax without them gets its default handler (the same checkpoint,
  written with that copy)."""
  try:
    from orbax.checkpoint._src.serialization import types as serialization_types  # noqa: PLC0415
  except ImportError:
    serialization_types = None
  if not hasattr(serialization_types, "DefaultSerializationStatusCallback"):
    logging.warning("orbax %s: the params are copied to host at once.", ocp.__version__)
    return ocp.PyTreeCheckpointHandler()

  priority = serialization_types.TransferPriority

  class Sliced(serialization_types.DefaultSerializationStatusCallback):
    def key_priority(self, keypath):  # The params in slices; the step and the rng (tiny) first.
      first = str(getattr(keypath[0], "key", keypath[0])) if keypath else ""
      return priority.ASYNCHRONOUS_DEPRIORITIZED if first == "params" else priority.SYNCHRONOUS

  arrays = ocp.type_handlers.ArrayHandler(callback=Sliced())
  return ocp.PyTreeCheckpointHandler(
    save_device_host_concurrent_gb=_START_SAVE_GB,
    type_handler_registry=ocp.type_handlers.create_type_handler_registry((jax.Array, arrays)),
  )


def _write_error(manager, step: Optional[int], error: Exception) -> CheckpointError:
  full = _is_disk_full(error)
  manager.reload()
  kept = [s for s in manager.all_steps() if step is None or s != step]
  where = f"of step {step} " if step is not None else ""
  return CheckpointError(
    f"Saving the checkpoint {where}in {manager.directory} failed: "
    f"{'the disk is full' if full else _reason(error)}. "
    + (
      f"The checkpoint of step {max(kept)} is intact: "
      if kept
      else "No earlier checkpoint exists: "
    )
    + ("free some space and " if full else "")
    + "rerun the same command to resume."
  )


def _is_disk_full(error: BaseException) -> bool:
  while error is not None:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
      return True
    if "No space left on device" in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


def _reason(error: Exception) -> str:
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def step_dir(manager: ocp.CheckpointManager, step: int) -> pathlib.Path:
  return pathlib.Path(manager.directory) / str(step)


def saved_config(manager: ocp.CheckpointManager, step: int) -> Optional[dict]:
  """The config stored with checkpoint `step`, or None if it cannot be read."""
  try:
    return manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
  except Exception:  # pylint: disable=broad-except  (an unreadable item: the caller falls back)
    return None


def newest_config(manager: ocp.CheckpointManager) -> Optional[dict]:
  """The config of the newest checkpoint whose config reads back (None: no checkpoint)."""
  manager.reload()
  for step in sorted(manager.all_steps(), reverse=True):
    config = saved_config(manager, step)
    if config is not None:
      return config
  return None


def unfinished_folders(manager: ocp.CheckpointManager) -> list[pathlib.Path]:
  """Temporary folders of saves that never completed (a crash mid-save)."""
  return sorted(p for p in pathlib.Path(manager.directory).glob("*.orbax-checkpoint-tmp*"))


def restore(
  manager: ocp.CheckpointManager, abstract_state: Any, log: Callable[[str], None] = print
) -> Optional[Restored]:
  """The newest checkpoint that reads back, onto the shardings of `abstract_state` (a pytree of
  jax.ShapeDtypeStruct); None if there is no checkpoint.

  Unreadable newer ones are reported through `log` and moved aside (never deleted) so
  the run can save those steps again; if none reads back, CheckpointError names each
  and why, and nothing is moved.
  """
  for folder in unfinished_folders(manager):
    log(f"Ignoring {folder}: the folder of a save that never completed (left in place).")
  manager.reload()
  steps = sorted(manager.all_steps(), reverse=True)
  failures = []
  for step in steps:
    try:
      restored = _restore_step(manager, step, abstract_state)
    except Exception as e:  # pylint: disable=broad-except  (any unreadable file: try an older one)
      failures.append((step, _reason(e)))
      log(
        f"Checkpoint {step_dir(manager, step)} cannot be read ({_reason(e)}); trying an older one."
      )
      continue
    if failures:
      _move_aside(manager, [bad for bad, _ in failures], log)
    return restored
  if failures:
    listing = "; ".join(f"step {step}: {reason}" for step, reason in failures)
    raise CheckpointError(
      f"No checkpoint in {manager.directory} can be read ({listing}). Nothing was "
      "deleted or moved; restore a copy, or use a new --workdir to start over."
    )
  return None


def restore_step(manager: ocp.CheckpointManager, step: int, abstract_state, role: str) -> Restored:
  """Checkpoint `step` onto the shardings of abstract_state; CheckpointError in one line naming
  `role` (what asked for it) when it is missing or does not read back."""
  manager.reload()
  steps = sorted(manager.all_steps())
  if step not in steps:
    raise CheckpointError(
      f"{role}: no checkpoint of step {step} in {manager.directory} (steps there: "
      f"{', '.join(map(str, steps)) or 'none'})."
    )
  try:
    return _restore_step(manager, step, abstract_state)
  except Exception as e:  # pylint: disable=broad-except  (any unreadable file)
    raise CheckpointError(
      f"{role}: checkpoint {step_dir(manager, step)} cannot be read ({_reason(e)})."
    ) from None


def _restore_step(manager, step: int, abstract_state) -> Restored:
  items = {"data": ocp.args.JsonRestore()}
  # A start (`save_start`) holds a `params` item in place of the state.
  is_start = (
    not (step_dir(manager, step) / "state").exists()
    and (step_dir(manager, step) / START_ITEM).exists()
  )
  if is_start:
    abstract_start = {key: getattr(abstract_state, key) for key in ("step", "params", "rng")}
    items[START_ITEM] = ocp.args.StandardRestore(abstract_start)
  else:
    items["state"] = ocp.args.StandardRestore(abstract_state)
  has_loop = (step_dir(manager, step) / "loop").exists()  # Absent in checkpoints of older versions.
  if has_loop:
    items["loop"] = ocp.args.JsonRestore()
  restored = manager.restore(step, args=ocp.args.Composite(**items))
  state = _state_of_start(restored[START_ITEM], abstract_state) if is_start else restored["state"]
  # A truncated array file can restore without an error but with missing chunks: check shapes.
  jax.tree.map(lambda x, a: _check_shape(x, a, step), state, abstract_state)
  loop_state = {
    "window": [],
    **(restored["loop"] if has_loop else {}),
  }  # Older checkpoints: no window.
  return Restored(step, state, restored["data"], loop_state)


def _state_of_start(start: dict, abstract_state):
  """The train state of a start (`save_start`), on abstract_state's shardings: its EMA a copy
  of its params, its optimizer state zeros (fresh), made where they live."""
  shardings = jax.tree.map(lambda a: a.sharding, abstract_state)

  def build(start):
    zeros = lambda a: jnp.zeros(a.shape, a.dtype)
    return abstract_state.replace(
      step=start["step"],
      params=start["params"],
      opt_state=jax.tree.map(zeros, abstract_state.opt_state),
      ema_params=jax.tree.map(jnp.copy, start["params"]),
      rng=start["rng"],
    )

  # Donated: the params are the state's own, not a copy of them.
  return jax.jit(build, out_shardings=shardings, donate_argnums=0)(start)


def _check_shape(value, abstract, step):
  if value.shape != abstract.shape or value.dtype != abstract.dtype:
    raise ValueError(
      f"step {step} holds an array {value.shape} {value.dtype} where "
      f"{abstract.shape} {abstract.dtype} was expected"
    )


def _move_aside(manager, steps: list[int], log):
  for step in steps:
    source = step_dir(manager, step)
    target = source.with_name(source.name + UNREADABLE_SUFFIX)
    if jax.process_index() == 0:
      source.rename(target)
    log(
      f"Moved the unreadable checkpoint {source} to {target} so that step {step} can be saved "
      "again; look at it, then delete it."
    )
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("md4jax: unreadable checkpoints moved aside")
  manager.reload()
