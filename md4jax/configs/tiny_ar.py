r"""The AR twin of configs/tiny.py: the same blocks with a causal mask and next-token loss.

python -m md4jax.main --config=configs/tiny_ar.py --workdir=/tmp/md4jax_tiny_ar
"""

from md4jax import config as config_lib


def get_config():
  config = config_lib.load_config("tiny")  # Same data, size and budget.
  config.model.type = "ar"  # Causal attention, next-token loss; eval reports the exact NLL.
  return config
