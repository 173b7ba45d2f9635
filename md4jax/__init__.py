"""md4jax: masked (absorbing-state) discrete diffusion language models in JAX.

The library's front door: the diffusion math and the block decoder over any
`denoise_fn(z_t, alpha_t) -> logits [B, L, V]` (V = mask_id) or `Denoiser`, the denoiser
network, the generated language whose exact law tests them, and `load` for a trained run or a
Hugging Face folder. Importing it loads neither the data pipeline (grain, tensorflow-datasets)
nor checkpoints or plots: `load` imports them when it is called.
"""

from md4jax.diffusion.bounds import bits_per_token, nelbo
from md4jax.diffusion.denoiser import Denoiser
from md4jax.diffusion.groundtruth import MarkovLanguage
from md4jax.diffusion.masking import corrupt
from md4jax.diffusion.schedules import get_schedule
from md4jax.model.transformer import Transformer
from md4jax.sampling.arguments import CACHES
from md4jax.sampling.decoder import sample
from md4jax.sampling.samplers import METHODS as SAMPLERS
from md4jax.sampling.samplers import NonFiniteLogitsError, check_logits, max_calls

__version__ = "0.2.0"


def load(path, **kwargs):
  """A trained run (an md4jax workdir) or a Hugging Face folder: an object with config, model,
  params (EMA by default; params="raw"), tokenizer, mask_id, schedule and a denoise_fn ready
  for `sample` and `nelbo`. Keyword arguments and errors: `md4jax.app.load.load`."""
  from md4jax.app import load as load_lib  # pylint: disable=import-outside-toplevel

  return load_lib.load(path, **kwargs)


__all__ = [
  "CACHES",
  "Denoiser",
  "MarkovLanguage",
  "NonFiniteLogitsError",
  "SAMPLERS",
  "Transformer",
  "bits_per_token",
  "check_logits",
  "corrupt",
  "get_schedule",
  "load",
  "max_calls",
  "nelbo",
  "sample",
]
