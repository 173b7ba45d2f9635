"""Several hosts: two processes × 4 CPU devices under jax.distributed (127.0.0.1) train, save,
restore and evaluate exactly like one process with 8 devices; a dying host ends the others."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import chex
import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint
from md4jax.training import state as state_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# 20 steps, checkpoints at 10 and 20; the two-process run shards the state (FSDP over 8 devices
# on 2 hosts), the reference replicates it (data parallel over 8 devices in one process).
FLAGS = [
  "--config.num_train_steps=20",
  "--config.checkpoint_every_steps=10",
  "--config.log_every_steps=5",
  "--config.eval_every_steps=20",
  "--config.sample.num_samples=2",
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _command(workdir, *flags):
  return [
    sys.executable,
    "-m",
    "md4jax.main",
    "--config=configs/tiny.py",
    f"--workdir={workdir}",
    *FLAGS,
    *flags,
  ]


def _env(devices: int) -> dict:
  return dict(
    os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
  )


def run_two_processes(workdir, *flags, stop_process=None) -> list[str]:
  """Both processes' stdout; each must exit 0. With stop_process, that process gets a SIGTERM
  once process 0 has run its first step."""
  port = _free_port()
  processes = [
    subprocess.Popen(
      _command(
        workdir,
        *flags,
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={i}",
      ),
      cwd=ROOT,
      env=_env(4),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  first = []
  if stop_process is not None:
    for line in processes[0].stdout:
      first.append(line)
      if "Compiled and ran the first step" in line:
        processes[stop_process].send_signal(signal.SIGTERM)
        break
  outputs = [process.communicate(timeout=600)[0] for process in processes]
  outputs[0] = "".join(first) + outputs[0]
  for process, output in zip(processes, outputs):
    assert process.returncode == 0, output[-3000:]
  return outputs


def _final(workdir):
  config = config_lib.load_config("tiny")
  abstract = state_lib.abstract_state(
    config,
    state_lib.build_model(config),
    state_lib.make_optimizer(config),
    sharding.make_mesh(config),
  )
  restored = checkpoint.restore(
    checkpoint.make_manager(workdir_lib.as_workdir(workdir).checkpoints, 3), abstract
  )
  return restored.step, restored.state, restored.data_state


def _metrics(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(reference, other):
  step_ref, state_ref, data_ref = _final(reference)
  step, state, data_state = _final(other)
  assert step == step_ref == 20 and data_state == data_ref == {"next_batch_index": 20}
  chex.assert_trees_all_close(state, state_ref, rtol=1e-5, atol=1e-7)
  metrics_ref, metrics = _metrics(reference), _metrics(other)
  assert [r["step"] for r in metrics] == [r["step"] for r in metrics_ref] == [5, 10, 15, 20]
  np.testing.assert_allclose(
    [r["loss"] for r in metrics], [r["loss"] for r in metrics_ref], rtol=1e-5
  )
  evaluation, evaluation_ref = (
    json.loads((w / "eval.json").read_text()) for w in (other, reference)
  )
  np.testing.assert_allclose(
    evaluation["nelbo_bits_per_token"], evaluation_ref["nelbo_bits_per_token"], rtol=1e-5
  )
  assert evaluation["num_sequences"] == evaluation_ref["num_sequences"] == 32


@pytest.mark.slow
def test_two_processes_match_one_process_and_stop_together_and_resume(tmp_path):
  reference, workdir = tmp_path / "one_process", tmp_path / "two_processes"
  result = subprocess.run(
    _command(reference), cwd=ROOT, env=_env(8), capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stderr[-3000:]

  # A SIGTERM to process 1 stops both at one step (jax.distributed's preemption sync point),
  # each exiting 0 after the checkpoint of that step, saved by both.
  outputs = run_two_processes(
    workdir, "--config.mesh.data=1", "--config.mesh.fsdp=-1", stop_process=1
  )
  stopped = [re.search(r"Stopped after step (\d+)", output) for output in outputs]
  assert all(stopped), outputs[0][-2000:]
  step = int(stopped[0].group(1))
  assert int(stopped[1].group(1)) == step < 20
  assert str(step) in [p.name for p in (workdir / "checkpoints").iterdir()]

  outputs = run_two_processes(workdir, "--config.mesh.data=1", "--config.mesh.fsdp=-1")
  assert f"Resuming from the checkpoint of step {step}" in outputs[0]
  assert "NELBO" in outputs[0] and "NELBO" in outputs[1]  # Metrics are global: both print them.
  _assert_same_run(reference, workdir)


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_a_dying_host_ends_the_others_within_the_heartbeat_timeout(tmp_path, victim):
  # --heartbeat_timeout_seconds bounds how long the survivor waits for a dead process.
  port, timeout = _free_port(), 10
  processes = [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "md4jax.main",
        "--config=configs/tiny.py",
        f"--workdir={tmp_path}",
        "--config.num_train_steps=1000000",
        "--config.log_every_steps=20",
        "--config.checkpoint_every_steps=1000000",
        "--config.eval_every_steps=1000000",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={i}",
        f"--heartbeat_timeout_seconds={timeout}",
      ],
      cwd=ROOT,
      env=_env(4),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  survivor = processes[1 - victim]
  for line in processes[0].stdout:  # Both are training once process 0 logs step 40.
    if "step 40/" in line:
      break
  processes[victim].kill()
  killed_at = time.monotonic()
  output = survivor.communicate(timeout=timeout + 120)[0]
  assert survivor.returncode != 0
  assert time.monotonic() - killed_at < timeout + 60
  assert "another task died" in output or "unhealthy" in output or "heartbeat" in output, output[
    -3000:
  ]
  processes[victim].wait()
