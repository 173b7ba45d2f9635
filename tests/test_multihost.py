"""Several hosts: two processes × 4 CPU devices under jax.distributed (127.0.0.1) train, save,
restore and evaluate exactly like one process with 8 devices."""

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np

from md4jax import checkpoint
from md4jax import config_lib
from md4jax import sharding
from md4jax import state as state_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# 20 steps, checkpoints at 10 and 20; the two-process run shards the state (FSDP over 8 devices
# on 2 hosts), the reference replicates it (data parallel over 8 devices in one process).
FLAGS = ["--config.num_train_steps=20", "--config.checkpoint_every_steps=10",
         "--config.log_every_steps=5", "--config.eval_every_steps=20", "--config.sample.num_samples=2"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _command(workdir, *flags):
  return [sys.executable, "-m", "md4jax.main", "--config=configs/tiny.py", f"--workdir={workdir}",
          *FLAGS, *flags]


def _env(devices: int) -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def run_two_processes(workdir, *flags) -> list[str]:
  """Both processes' stdout; each must exit 0."""
  port = _free_port()
  processes = [subprocess.Popen(
      _command(workdir, *flags, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
               f"--process_id={i}"), cwd=ROOT, env=_env(4), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  outputs = [process.communicate(timeout=600) for process in processes]
  for process, (_, stderr) in zip(processes, outputs):
    assert process.returncode == 0, stderr[-3000:]
  return [stdout for stdout, _ in outputs]


def _final(workdir):
  config = config_lib.load_config("tiny")
  abstract = state_lib.abstract_state(config, state_lib.build_model(config),
                                      state_lib.make_optimizer(config), sharding.make_mesh(config))
  return checkpoint.restore(checkpoint.make_manager(workdir, 3), abstract)


def _metrics(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(reference, other):
  step_ref, state_ref, data_ref = _final(reference)
  step, state, data_state = _final(other)
  assert step == step_ref == 20 and data_state == data_ref == {"next_batch_index": 20}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), state, state_ref)
  metrics_ref, metrics = _metrics(reference), _metrics(other)
  assert [r["step"] for r in metrics] == [r["step"] for r in metrics_ref] == [5, 10, 15, 20]
  np.testing.assert_allclose([r["loss"] for r in metrics], [r["loss"] for r in metrics_ref], rtol=1e-5)
  evaluation, evaluation_ref = (json.loads((w / "eval.json").read_text()) for w in (other, reference))
  np.testing.assert_allclose(evaluation["nelbo_bits_per_token"], evaluation_ref["nelbo_bits_per_token"],
                             rtol=1e-5)
  assert evaluation["num_sequences"] == evaluation_ref["num_sequences"] == 32


def test_two_processes_match_one_process_and_resume(tmp_path):
  reference, workdir = tmp_path / "one_process", tmp_path / "two_processes"
  result = subprocess.run(_command(reference), cwd=ROOT, env=_env(8), capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]

  stdouts = run_two_processes(workdir, "--config.mesh.data=1", "--config.mesh.fsdp=-1")
  assert "NELBO" in stdouts[0] and "NELBO" in stdouts[1]  # Metrics are global: both print them.
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["10", "20"]
  _assert_same_run(reference, workdir)

  # Restore on two processes: from the step-10 checkpoint, saved by both, to the same end.
  shutil.rmtree(workdir / "checkpoints" / "20")
  stdouts = run_two_processes(workdir, "--config.mesh.data=1", "--config.mesh.fsdp=-1")
  assert "Resuming from the checkpoint of step 10" in stdouts[0]
  _assert_same_run(reference, workdir)
