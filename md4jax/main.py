r"""Trains, evaluates or samples a masked diffusion (or AR) language model.

  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default
  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default --mode=eval
  python -m md4jax.main --config=configs/tiny.py --workdir=/tmp/tiny --config.num_train_steps=50
  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default --mode=frontier \
      --config.eval.judge_workdir=/tmp/md4jax_default_ar

A workdir that holds checkpoints resumes training from the latest one.
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from md4jax import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and samples.")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "eval", "sample", "frontier"],
                          "train (then eval and sample), or eval / sample / sweep the sample-quality "
                          "frontier (md4jax.frontier) of the latest checkpoint.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  config = _CONFIG.value
  if _MODE.value == "train":
    train.train_and_evaluate(config, _WORKDIR.value)
  elif _MODE.value == "eval":
    train.evaluate_checkpoint(config, _WORKDIR.value)
  elif _MODE.value == "frontier":
    train.frontier_checkpoint(config, _WORKDIR.value)
  else:
    train.sample_checkpoint(config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
