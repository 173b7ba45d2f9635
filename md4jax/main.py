r"""Trains, evaluates, samples, post-trains or distills a masked diffusion (or AR) language model.

  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default
  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default --mode=eval
  python -m md4jax.main --config=configs/tiny.py --workdir=/tmp/tiny --config.num_train_steps=50
  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default --mode=frontier \
      --config.eval.judge_workdir=/tmp/md4jax_default_ar
  python -m md4jax.main --config=configs/post_train.py --workdir=/tmp/post --mode=post_train \
      --config.post_train.init_from=/tmp/md4jax_default --config.post_train.reward=bigram:R.npy
  python -m md4jax.main --config=configs/distill.py --workdir=/tmp/distill --mode=distill \
      --config.distill.init_from=/tmp/md4jax_default

A workdir that holds checkpoints resumes training from the latest one.

Several processes (hosts) form one run through jax.distributed: on TPU VMs and
under SLURM or Open MPI it starts by itself; elsewhere give every process the
same --coordinator_address=HOST:PORT and --num_processes=N and its own
--process_id=I (launch/README.md).
"""

import os

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from md4jax import config as config_lib
from md4jax import user_errors
from md4jax.app import distill, modes, post_train
from md4jax.runtime import allocator
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "A config: md4jax's by name (default, tiny, text8:cpu, ...) or a config file's path.",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and samples.")
_MODE = flags.DEFINE_enum(
  "mode",
  "train",
  ["train", "eval", "sample", "frontier", "post_train", "distill"],
  "train (then eval and sample), or eval / sample / sweep the sample-quality "
  "frontier (md4jax.app.frontier) of the latest checkpoint, or post-train "
  "post_train.init_from's model with a reward (md4jax.app.post_train), or distill "
  "distill.init_from's model into a few-step student (md4jax.app.distill).",
)
_COORDINATOR_ADDRESS = flags.DEFINE_string(
  "coordinator_address", None, "HOST:PORT of process 0, for a run of several processes."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "This process's index in [0, num_processes)."
)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
  "heartbeat_timeout_seconds",
  100,
  "Several processes: when one stops answering (a dead host) for this long, the others end "
  "with an error instead of waiting for it forever.",
)
flags.mark_flags_as_required(["config", "workdir"])

# Errors about the user's config, files or workdir: reported in one line, without a traceback.
USER_ERRORS = (
  ValueError,
  FileNotFoundError,
  UnicodeDecodeError,
  workdir_lib.WorkdirError,
  checkpoint.CheckpointError,
)

_MODES = {
  "train": modes.train_and_evaluate,
  "eval": modes.evaluate_checkpoint,
  "sample": modes.sample_checkpoint,
  "frontier": modes.frontier_checkpoint,
  "post_train": post_train.post_train,
  "distill": distill.distill,
}


def _in_multiprocess_cluster() -> bool:
  """A TPU VM (jax finds its workers itself), or a SLURM / Open MPI job of several tasks."""
  on_tpu_vm = os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
  tasks = max(int(os.environ.get(name, "1")) for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
  return on_tpu_vm or tasks > 1


def _initialize_distributed():
  given = [_COORDINATOR_ADDRESS.value, _NUM_PROCESSES.value, _PROCESS_ID.value]
  if any(value is not None for value in given):
    if any(value is None for value in given):
      raise app.UsageError("--coordinator_address, --num_processes and --process_id go together.")
    jax.distributed.initialize(
      coordinator_address=_COORDINATOR_ADDRESS.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
      heartbeat_timeout_seconds=_HEARTBEAT_TIMEOUT.value,
    )
  elif _in_multiprocess_cluster():
    jax.distributed.initialize(heartbeat_timeout_seconds=_HEARTBEAT_TIMEOUT.value)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  if _CONFIG.value.reuse_freed_host_memory:
    allocator.reuse_freed_host_memory()  # Before JAX starts the threads that allocate.
  if _CONFIG.value.cpu_devices:  # Before any backend starts; accelerator hosts ignore it.
    jax.config.update("jax_num_cpu_devices", _CONFIG.value.cpu_devices)
  _initialize_distributed()
  # What the user must fix, in one line; --verbosity=1 shows the traceback.
  with user_errors.in_one_line("md4jax", USER_ERRORS, flags.FLAGS["verbosity"].present):
    # The overrides on the command line are explicit: a preset may not silently replace them.
    overrides = config_flags.get_override_values(flags.FLAGS["config"])
    config = config_lib.expand_preset(_CONFIG.value, explicit=overrides)
    _MODES[_MODE.value](config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=config_lib.parse_flags)
