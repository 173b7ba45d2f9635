"""Preemption and recovery: stop signals, unreadable checkpoints, the workdir lock, resume
compatibility, and a disk that fills up during a save."""

import errno
import glob
import hashlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import chex
import jax
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from md4jax import config as config_lib
from md4jax.app import modes
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint, preemption
from md4jax.training import state as state_lib


def tiny(**overrides):
  config = config_lib.load_config("tiny")
  config.sample.num_samples = 0
  for key, value in overrides.items():
    *parents, leaf = key.split("__")
    target = config
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  return config


def restore(workdir, config=None):
  config = config or tiny()
  abstract = state_lib.abstract_state(
    config,
    state_lib.build_model(config),
    state_lib.make_optimizer(config),
    sharding.make_mesh(config),
  )
  return checkpoint.restore(
    checkpoint.make_manager(workdir_lib.as_workdir(workdir).checkpoints, 3),
    abstract,
    log=lambda _: None,
  )


def snapshot(root) -> dict:
  """Every file under root and its content hash."""
  return {
    str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
    for p in sorted(pathlib.Path(root).rglob("*"))
    if p.is_file()
  }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """configs/tiny.py trained in process: checkpoints at steps 10 and 20, metrics, eval."""
  workdir = tmp_path_factory.mktemp("trained")
  config = tiny()
  config.eval.discrete_steps, config.eval.profile_bins = "", 0  # What matters: the files it leaves.
  modes.train_and_evaluate(config, workdir)
  return workdir


@pytest.fixture
def workdir(trained, tmp_path):
  copy = tmp_path / "work"
  shutil.copytree(trained, copy)
  return copy


# ---- Stop signals


def test_first_signal_asks_to_stop_and_a_second_ctrl_c_aborts():
  with preemption.StopSignals() as stop:
    assert not stop.stop_after(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.received == "SIGTERM" and stop.stop_after(2)
    with pytest.raises(KeyboardInterrupt, match="Second SIGINT"):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # Restored on exit.


def test_a_stopped_run_resumes_to_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch):
  reference = tmp_path / "reference"
  modes.train_and_evaluate(tiny(), reference)
  # The sync point says "stop" after step 7 (as a SIGTERM would): a checkpoint of step 7.
  monkeypatch.setattr(preemption.StopSignals, "stop_after", lambda self, step: step == 7)
  stopped = tmp_path / "stopped"
  assert modes.train_and_evaluate(tiny(), stopped) is None
  assert restore(stopped).step == 7 and not (stopped / "eval.json").exists()
  monkeypatch.undo()
  modes.train_and_evaluate(tiny(), stopped)
  final, expected = restore(stopped), restore(reference)
  assert final.step == expected.step == 20 and final.data_state == expected.data_state
  chex.assert_trees_all_equal(final.state, expected.state)
  timing = ("tokens_per_second",)
  read = lambda w: [
    {k: v for k, v in json.loads(line).items() if k not in timing}
    for line in (w / "metrics.jsonl").read_text().splitlines()
  ]
  assert read(stopped) == read(reference)  # Steps 5 and 10 logged once; the same values.


# ---- Unreadable checkpoints


def _truncate_an_array_file(step_dir):
  # Every data file: OCDBT may leave data files no array refers to any more (after compaction),
  # so cutting only one could miss what the restore reads.
  for path in glob.glob(str(step_dir / "state" / "ocdbt.process_0" / "d" / "*")):
    with open(path, "r+b") as f:
      f.truncate(10)


@pytest.mark.parametrize(
  "damage, reason",
  [
    (_truncate_an_array_file, "reading array"),
    (lambda d: shutil.rmtree(d / "data"), 'Item "data" was not found'),
    (lambda d: (d / "state" / "_METADATA").write_text("garbage{"), "JSONDecodeError"),
    (lambda d: (d / "state" / "manifest.ocdbt").unlink(), "NOT_FOUND"),
  ],
)
def test_an_unreadable_checkpoint_falls_back_to_an_older_one_and_is_kept(workdir, damage, reason):
  damage(workdir / "checkpoints" / "20")
  messages = []
  abstract = state_lib.abstract_state(
    tiny(),
    state_lib.build_model(tiny()),
    state_lib.make_optimizer(tiny()),
    sharding.make_mesh(tiny()),
  )
  restored = checkpoint.restore(
    checkpoint.make_manager(workdir_lib.as_workdir(workdir).checkpoints, 3),
    abstract,
    log=messages.append,
  )
  assert restored.step == 10
  assert "checkpoints/20 cannot be read" in messages[0] and reason in messages[0]
  assert (workdir / "checkpoints" / "20.unreadable" / "state").is_dir()  # Moved aside, not deleted.
  assert "20.unreadable" in messages[1]


def test_training_goes_on_from_the_newest_readable_checkpoint(workdir):
  _truncate_an_array_file(workdir / "checkpoints" / "20")
  modes.train_and_evaluate(tiny(num_train_steps=30), workdir)
  assert restore(workdir).step == 30
  assert (workdir / "checkpoints" / "20").is_dir() and (
    workdir / "checkpoints" / "20.unreadable"
  ).is_dir()


def test_the_folder_of_an_unfinished_save_is_reported_and_left_alone(workdir):
  unfinished = workdir / "checkpoints" / "30.orbax-checkpoint-tmp-1733000000"
  shutil.copytree(workdir / "checkpoints" / "20", unfinished)
  messages = []
  abstract = state_lib.abstract_state(
    tiny(),
    state_lib.build_model(tiny()),
    state_lib.make_optimizer(tiny()),
    sharding.make_mesh(tiny()),
  )
  assert (
    checkpoint.restore(
      checkpoint.make_manager(workdir_lib.as_workdir(workdir).checkpoints, 3),
      abstract,
      log=messages.append,
    ).step
    == 20
  )
  assert "never completed" in messages[0] and unfinished.is_dir()


def test_no_readable_checkpoint_is_a_clear_error_and_nothing_is_touched(workdir):
  for step in (10, 20):
    shutil.rmtree(workdir / "checkpoints" / str(step) / "data")
  before = snapshot(workdir)
  with pytest.raises(
    checkpoint.CheckpointError,
    match=r"No checkpoint in .* can be read \(step 20: "
    r".*; step 10: .*\)\. Nothing was deleted",
  ):
    modes.train_and_evaluate(tiny(), workdir)
  assert snapshot(workdir) == before


# ---- The workdir lock


def _hold_lock(workdir, **holder):
  record = {"host": socket.gethostname(), "pid": os.getpid(), "mode": "train", "since": "then"}
  (workdir / "lock").write_text(json.dumps({**record, **holder}))


@pytest.mark.parametrize(
  "mode", [modes.train_and_evaluate, modes.evaluate_checkpoint, modes.sample_checkpoint]
)
def test_a_second_writer_is_refused_naming_the_holder(workdir, mode):
  _hold_lock(workdir)  # This very process: alive.
  before = snapshot(workdir)
  with pytest.raises(
    workdir_lib.WorkdirError,
    match=rf"in use: a train run holds .*lock, PID {os.getpid()} on host "
    rf"{socket.gethostname()}",
  ):
    mode(tiny(), workdir)
  assert snapshot(workdir) == before


def test_a_lock_on_another_host_is_respected(workdir):
  _hold_lock(workdir, host="elsewhere", pid=1)
  with pytest.raises(workdir_lib.WorkdirError, match="PID 1 on host elsewhere"):
    modes.evaluate_checkpoint(tiny(), workdir)


def test_a_lock_left_by_a_dead_process_is_taken_over(workdir, capsys):
  dead = subprocess.run(
    [sys.executable, "-c", "import os; print(os.getpid())"],
    capture_output=True,
    text=True,
    check=True,
  )
  _hold_lock(workdir, pid=int(dead.stdout))
  modes.evaluate_checkpoint(tiny(), workdir)
  assert (
    f"Taking over {workdir / 'lock'}: it was left by PID {int(dead.stdout)}"
    in capsys.readouterr().out
  )
  assert not (workdir / "lock").exists()  # Released at the end.


def test_frontier_runs_beside_a_training_run(workdir):
  _hold_lock(workdir)
  config = tiny()
  config.frontier.methods, config.frontier.num_steps, config.frontier.temperatures = (
    "ancestral",
    "4",
    "1",
  )
  config.frontier.num_samples = 4
  modes.frontier_checkpoint(config, workdir)
  assert json.loads((workdir / "frontier.json").read_text())["points"]


def test_a_read_only_workdir_fails_before_any_work():
  read_only = pathlib.Path("/sys/kernel")  # sysfs: no file can be created there, even by root.
  try:
    (read_only / "md4jax-probe").touch()
    pytest.skip("/sys/kernel is writable on this machine")
  except OSError:
    pass
  with pytest.raises(
    workdir_lib.WorkdirError,
    match=r"Cannot write in the workdir /sys/kernel: "
    r".*Choose a --workdir on a writable disk",
  ):
    modes.train_and_evaluate(tiny(), read_only)


# ---- Resume compatibility


def test_resuming_with_a_config_the_checkpoint_cannot_hold_fails_naming_each_key(workdir):
  before = snapshot(workdir)
  changed = tiny(model__num_layers=2, data__seq_len=32, model__type="ar", seed=1)
  with pytest.raises(
    ValueError,
    match=r"Cannot resume .*\(data.seq_len: 16 → 32; model.num_layers: 1 → 2; "
    r"model.type: 'mdm' → 'ar'; seed: 0 → 1\)",
  ):
    modes.train_and_evaluate(changed, workdir)
  assert snapshot(workdir) == before


def test_resuming_with_safe_changes_goes_on(workdir):
  # Steps, logging, batch size, learning rate, mesh, evaluation: none changes what the
  # checkpoint holds.
  config = tiny(
    num_train_steps=24,
    log_every_steps=4,
    batch_size=32,
    optimizer__learning_rate=1e-3,
    mesh__data=1,
    mesh__fsdp=-1,
    eval__num_mc_samples=1,
  )
  modes.train_and_evaluate(config, workdir)
  assert restore(workdir, config).step == 24


def test_a_workdir_written_before_the_package_layout_move_resumes(tmp_path):
  # tests/data/workdir_before_layout: `configs/tiny.py` run for 10 steps by the flat-module
  # package (before md4jax/ had subpackages); its checkpoint names no module path.
  old = tmp_path / "old"
  shutil.copytree(pathlib.Path(__file__).parent / "data" / "workdir_before_layout", old)
  assert restore(old).step == 10
  config = tiny(num_train_steps=12)
  config.eval.discrete_steps, config.eval.profile_bins = "", 0
  modes.train_and_evaluate(config, old)
  assert restore(old, config).step == 12


# ---- A full disk


def test_a_disk_that_fills_up_during_a_save_stops_the_run_and_keeps_the_last_checkpoint(
  workdir, monkeypatch
):
  save = json_checkpoint_handler.JsonCheckpointHandler._save_fn

  def fail_at_step_30(self, x, directory):
    if "/30" in str(directory):
      raise OSError(errno.ENOSPC, "No space left on device", str(directory))
    return save(self, x, directory)

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", fail_at_step_30)
  with pytest.raises(
    checkpoint.CheckpointError,
    match=r"checkpoint of step 30 .* failed: the disk is "
    r"full\. The checkpoint of step 20 is intact",
  ):
    modes.train_and_evaluate(tiny(num_train_steps=40), workdir)
  monkeypatch.undo()
  assert restore(workdir).step == 20
  assert jax.tree.leaves(restore(workdir).state.params)
