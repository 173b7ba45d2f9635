r"""The config an existing workdir holds (its config.json): a converted model, or any md4jax run,
continued with its own settings.

  python -m md4jax.main --config=configs/workdir.py:/tmp/qwen --workdir=/tmp/qwen --mode=sample
  python -m md4jax.main --config=configs/workdir.py:/tmp/qwen --workdir=/tmp/qwen \
      --config.num_train_steps=2000

Keys may still be overridden on the command line; those that decide what the checkpoint holds
(declared fixed in md4jax.config.base_config) must keep their saved values. docs/convert.md.
"""

from md4jax import config as config_lib


def get_config(workdir: str):
  return config_lib.workdir_config(workdir, "configs/workdir.py:PATH")
