"""The layout of a run's working directory: every file md4jax reads or writes there.

Modules that write into a workdir take a `Workdir` and use its paths, so the
layout lives here only:

  config.json        the run's config (written by training, read by a judge)
  metrics.jsonl      one record per logged training step
  eval.json, eval.md the latest evaluation and its report
  samples.jsonl      the latest samples
  frontier.json      the sampler sweep (--mode=frontier)
  trajectory.html, trajectory.gif   the first sample's reverse process
  plots/             PNG plots
  tensorboard/       TensorBoard event files
  tokenizer.json     the text tokenizer, reused on resume
  data_cache/        tokenized corpora
  checkpoints/       orbax checkpoints, one folder per step
  lock               held by the process that writes the workdir
"""

import dataclasses
import json
import os
import pathlib
import socket
import sys
import time
from typing import Optional

from md4jax.data.tokenizer import TOKENIZER_FILE


@dataclasses.dataclass(frozen=True)
class Workdir:
  """Paths inside one run's working directory."""

  root: pathlib.Path

  def __init__(self, root):
    object.__setattr__(self, "root", pathlib.Path(root))

  def __fspath__(self) -> str:
    return str(self.root)

  def __str__(self) -> str:
    return str(self.root)

  @property
  def config_json(self) -> pathlib.Path:
    return self.root / "config.json"

  @property
  def metrics_jsonl(self) -> pathlib.Path:
    return self.root / "metrics.jsonl"

  @property
  def eval_json(self) -> pathlib.Path:
    return self.root / "eval.json"

  @property
  def eval_md(self) -> pathlib.Path:
    return self.root / "eval.md"

  @property
  def samples_jsonl(self) -> pathlib.Path:
    return self.root / "samples.jsonl"

  @property
  def frontier_json(self) -> pathlib.Path:
    return self.root / "frontier.json"

  @property
  def trajectory_html(self) -> pathlib.Path:
    return self.root / "trajectory.html"

  @property
  def trajectory_gif(self) -> pathlib.Path:
    return self.root / "trajectory.gif"

  @property
  def plots(self) -> pathlib.Path:
    return self.root / "plots"

  @property
  def tensorboard(self) -> pathlib.Path:
    return self.root / "tensorboard"

  @property
  def tokenizer(self) -> pathlib.Path:
    return self.root / TOKENIZER_FILE

  @property
  def data_cache(self) -> pathlib.Path:
    return self.root / "data_cache"

  @property
  def checkpoints(self) -> pathlib.Path:
    return self.root / "checkpoints"

  @property
  def lock(self) -> pathlib.Path:
    return self.root / "lock"

  def plot(self, name: str) -> pathlib.Path:
    """plots/<name>, the folder created on demand."""
    self.plots.mkdir(parents=True, exist_ok=True)
    return self.plots / name


def as_workdir(workdir) -> Workdir:
  """A Workdir from a path or a Workdir."""
  return workdir if isinstance(workdir, Workdir) else Workdir(workdir)


class WorkdirError(RuntimeError):
  """The workdir cannot be used: in use by another run, or not writable."""


class Lock:
  """The workdir's lock file, held by the one run that writes there.

  The file holds {"host", "pid", "mode", "since", "command"} as JSON and is
  created with O_EXCL, so two runs racing for it cannot both win. A lock held
  by a process that no longer runs on this host is taken over (with a
  message); a live holder, or one on another host (whose liveness cannot be
  checked from here), makes the second run fail, naming it.
  """

  def __init__(self, workdir, mode: str, log=print):
    self.workdir, self.mode, self.log = as_workdir(workdir), mode, log
    self.record = {
      "host": socket.gethostname(),
      "pid": os.getpid(),
      "mode": mode,
      "since": time.strftime("%Y-%m-%d %H:%M:%S"),
      "command": " ".join(sys.argv),
    }

  def __enter__(self) -> "Lock":
    path = self.workdir.lock
    try:
      self.workdir.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise WorkdirError(
        f"Cannot create the workdir {self.workdir}: {e.strerror or e}. "
        "Choose a --workdir on a writable disk."
      ) from None
    for _ in range(3):
      try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        self._take_over_if_stale(path)
        continue
      except OSError as e:
        raise WorkdirError(
          f"Cannot write in the workdir {self.workdir}: {e.strerror or e}. "
          "Choose a --workdir on a writable disk."
        ) from None
      with os.fdopen(fd, "w") as f:
        f.write(json.dumps(self.record) + "\n")
      return self
    raise WorkdirError(f"Could not take {path}: other runs keep taking it.")

  def _take_over_if_stale(self, path: pathlib.Path):
    holder = _read_holder(path)
    if holder is None:  # Just created, not yet written: a run is starting there.
      time.sleep(0.5)
      holder = _read_holder(path)
    if holder is not None and _alive(holder):
      raise WorkdirError(
        f"The workdir {self.workdir} is in use: a {holder.get('mode', '?')} run holds {path}, "
        f"PID {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}. "
        "Wait for it to end, or use another --workdir; if that process is gone for sure, "
        f"delete {path}."
      )
    who = (
      f"PID {holder.get('pid')} on {holder.get('host')}, which no longer runs"
      if holder
      else "an unreadable lock"
    )
    self.log(f"Taking over {path}: it was left by {who}.")
    path.unlink(missing_ok=True)

  def __exit__(self, *exc_info):
    holder = _read_holder(self.workdir.lock)
    if (
      holder is not None
      and holder.get("pid") == self.record["pid"]
      and holder.get("host") == self.record["host"]
    ):
      self.workdir.lock.unlink(missing_ok=True)


def _read_holder(path: pathlib.Path) -> Optional[dict]:
  try:
    holder = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  return holder if isinstance(holder, dict) else None


def _alive(holder: dict) -> bool:
  """Whether the lock's holder still runs (always True for another host: it cannot be checked)."""
  if holder.get("host") != socket.gethostname():
    return True
  pid = holder.get("pid")
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  cmdline = pathlib.Path(f"/proc/{pid}/cmdline")
  if cmdline.exists():  # A reused PID: the process there is no Python.
    return b"python" in cmdline.read_bytes()
  return True
