"""Chaos: runs killed (SIGKILL) at random moments, some in the middle of an async checkpoint save,
and stopped (SIGTERM) at others, each restarted with the same command, end exactly where an
uninterrupted run ends: params, EMA, optimizer and data state bit for bit, and metrics.jsonl with
every logged step once and the same values. The default suite runs a few interruptions; the
long run (10 SIGKILLs and 5 SIGTERMs) is marked slow."""

import json
import pathlib
import random
import signal
import subprocess
import sys
import time

import chex
import pytest

from md4jax import config as config_lib
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint
from md4jax.training import state as state_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 200
FLAGS = [
  f"--config.num_train_steps={STEPS}",
  "--config.checkpoint_every_steps=20",
  "--config.log_every_steps=5",
  f"--config.eval_every_steps={STEPS}",
  "--config.sample.num_samples=0",
  "--config.eval.num_sequences=16",
]


def _command(workdir):
  return [
    sys.executable,
    "-m",
    "md4jax.main",
    "--config=configs/tiny.py",
    f"--workdir={workdir}",
    *FLAGS,
  ]


def _final(workdir):
  config = config_lib.load_config("tiny")
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


def _metrics(workdir):
  return [
    {k: v for k, v in json.loads(line).items() if k != "tokens_per_second"}
    for line in (workdir / "metrics.jsonl").read_text().splitlines()
  ]


def _interrupt(workdir, signum, moment, rng) -> str:
  """Starts the run and sends `signum` at `moment`: "save" (while a checkpoint is being written)
  or a delay in seconds after the first training step. Returns how it ended."""
  process = subprocess.Popen(
    _command(workdir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  deadline = time.monotonic() + 300
  for line in process.stdout:  # Wait for training to start (compiled, first step run).
    if "Compiled and ran the first step" in line or time.monotonic() > deadline:
      break
  if moment == "save":
    folder = workdir / "checkpoints"
    while process.poll() is None and not list(folder.glob("*.orbax-checkpoint-tmp*")):
      time.sleep(0.001)
  else:
    time.sleep(moment * rng.uniform(0.5, 1.0))
  if process.poll() is None:
    process.send_signal(signum)
  output = process.communicate(timeout=300)[0]
  if "Rerun the same command to resume" in output:  # Stopped in the training loop: a clean exit.
    assert process.returncode == 0, output[-3000:]
  return output


def _check_same_as_uninterrupted(reference, workdir):
  result = subprocess.run(_command(workdir), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  expected, final = _final(reference), _final(workdir)
  assert final.step == expected.step == STEPS and final.data_state == expected.data_state
  chex.assert_trees_all_equal(final.state, expected.state)  # Bit for bit.
  assert _metrics(workdir) == _metrics(reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  result = subprocess.run(_command(workdir), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert [r["step"] for r in _metrics(workdir)] == list(range(5, STEPS + 1, 5))
  return workdir


def _chaos(reference, workdir, interruptions, seed):
  rng = random.Random(seed)
  stops = 0
  for signum, moment in interruptions:
    output = _interrupt(workdir, signum, moment, rng)
    if signum == signal.SIGTERM and "Rerun the same command to resume" in output:
      stops += 1
  _check_same_as_uninterrupted(reference, workdir)
  return stops


@pytest.mark.slow
def test_kills_and_stops_resume_exactly(reference, tmp_path):
  interruptions = [(signal.SIGKILL, "save"), (signal.SIGTERM, 1.0), (signal.SIGKILL, 2.0)]
  assert _chaos(reference, tmp_path / "chaos", interruptions, seed=0) == 1


@pytest.mark.slow
def test_ten_kills_and_five_stops_at_random_moments_resume_exactly(reference, tmp_path):
  rng = random.Random(1)
  interruptions = [
    (signal.SIGKILL, "save" if i % 3 == 0 else rng.uniform(0.2, 3.0)) for i in range(10)
  ]
  interruptions += [(signal.SIGTERM, rng.uniform(0.2, 3.0)) for _ in range(5)]
  rng.shuffle(interruptions)
  assert _chaos(reference, tmp_path / "chaos", interruptions, seed=2) >= 1
