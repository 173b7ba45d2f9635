"""md4jax: masked (absorbing-state) discrete diffusion language models in JAX.

The library's front door: the diffusion math and the samplers over any
`denoise_fn(z_t, alpha_t) -> logits [B, L, V]` (V = mask_id), the denoiser network, and the
generated language whose exact law tests them. Importing it loads neither the data pipeline
(grain, tensorflow-datasets) nor checkpoints or plots; those live in the subpackages that
`python -m md4jax.main` uses.
"""

from md4jax.diffusion.bounds import bits_per_token, nelbo
from md4jax.diffusion.groundtruth import MarkovLanguage
from md4jax.diffusion.masking import corrupt
from md4jax.diffusion.schedules import get_schedule
from md4jax.model.transformer import Transformer
from md4jax.sampling.samplers import METHODS as SAMPLERS
from md4jax.sampling.samplers import NonFiniteLogitsError, check_logits, max_calls, sample

__version__ = "0.1.0"

__all__ = [
  "MarkovLanguage",
  "NonFiniteLogitsError",
  "SAMPLERS",
  "Transformer",
  "bits_per_token",
  "check_logits",
  "corrupt",
  "get_schedule",
  "max_calls",
  "nelbo",
  "sample",
]
