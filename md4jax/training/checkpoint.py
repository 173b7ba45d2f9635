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
"""

import dataclasses
import errno
import json
import pathlib
from typing import Any, Callable, Optional

import jax
import ml_collections
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

ITEMS = ("state", "data", "loop", "config")
UNREADABLE_SUFFIX = ".unreadable"


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


def make_manager(directory, max_to_keep: int) -> ocp.CheckpointManager:
  """The manager of the checkpoints folder `directory` (created by the first save)."""
  options = ocp.CheckpointManagerOptions(
    max_to_keep=max_to_keep, enable_async_checkpointing=True, create=True
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
  items = {"state": ocp.args.StandardRestore(abstract_state), "data": ocp.args.JsonRestore()}
  has_loop = (step_dir(manager, step) / "loop").exists()  # Absent in checkpoints of older versions.
  if has_loop:
    items["loop"] = ocp.args.JsonRestore()
  restored = manager.restore(step, args=ocp.args.Composite(**items))
  state = restored["state"]
  # A truncated array file can restore without an error but with missing chunks: check shapes.
  jax.tree.map(lambda x, a: _check_shape(x, a, step), state, abstract_state)
  loop_state = {
    "window": [],
    **(restored["loop"] if has_loop else {}),
  }  # Older checkpoints: no window.
  return Restored(step, state, restored["data"], loop_state)


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
