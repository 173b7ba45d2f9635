r"""Self-conditioning's effect on the bound, paired: two workdirs of one process (one with
model.self_condition) scored on the same held-out sequences with the same draws, so the SE is
that of the per-sequence difference. Prints JSON.

  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default
  python -m md4jax.main --config=configs/default.py --workdir=/tmp/md4jax_default_sc \
      --config.model.self_condition=True
  python benchmarks/self_conditioning.py --plain=/tmp/md4jax_default --conditioned=/tmp/md4jax_default_sc

The self-conditioned model is scored as its bound is defined (two passes: docs/math.md § 14),
each draw a mask_count draw (masked) or the standard one (uniform), eval.num_mc_samples draws
per sequence over eval.num_sequences sequences of the language's evaluation stream.
"""

import json
import math

import jax
import numpy as np
from absl import app, flags

import md4jax
from md4jax import rng

_PLAIN = flags.DEFINE_string("plain", None, "A trained workdir without self-conditioning.")
_CONDITIONED = flags.DEFINE_string("conditioned", None, "The same run with model.self_condition.")
flags.mark_flags_as_required(["plain", "conditioned"])


def _nats(loaded, x, key, num_draws: int) -> np.ndarray:
  """Mean NELBO draws per sequence [N] in nats."""
  config = loaded.config
  uniform = config.diffusion.process == "uniform"
  kwargs = dict(process="uniform") if uniform else dict(mask_id=config.data.vocab_size)
  estimator = "standard" if uniform else "mask_count"
  draw = jax.jit(
    lambda key, denoiser: md4jax.nelbo(
      key, denoiser, x, loaded.schedule, estimator=estimator, **kwargs
    )
  )
  draws = [
    np.asarray(draw(jax.random.fold_in(key, i), loaded.denoise_fn)) for i in range(num_draws)
  ]
  return np.mean(draws, axis=0).astype(np.float64)


def main(argv):
  del argv
  plain, conditioned = md4jax.load(_PLAIN.value), md4jax.load(_CONDITIONED.value)
  if not conditioned.config.model.self_condition or plain.config.model.self_condition:
    raise app.UsageError("--conditioned must be the self-conditioned run, --plain the other.")
  config = plain.config
  length, language = config.data.seq_len, plain.language
  x = language.sample(
    rng.stream(config.data.language_seed, "eval_data"), config.eval.num_sequences, length
  )
  key = jax.random.PRNGKey(0)
  to_bits = 1.0 / (length * math.log(2.0))
  plain_bits = _nats(plain, x, key, config.eval.num_mc_samples) * to_bits
  conditioned_bits = _nats(conditioned, x, key, config.eval.num_mc_samples) * to_bits
  difference = conditioned_bits - plain_bits
  n = difference.size
  print(
    json.dumps(
      {
        "process": config.diffusion.process,
        "num_sequences": n,
        "draws_per_sequence": config.eval.num_mc_samples,
        "true_bits_per_token": language.entropy(length) / (length * math.log(2.0)),
        "plain_bits_per_token": plain_bits.mean(),
        "plain_stderr": plain_bits.std(ddof=1) / math.sqrt(n),
        "conditioned_bits_per_token": conditioned_bits.mean(),
        "conditioned_stderr": conditioned_bits.std(ddof=1) / math.sqrt(n),
        "difference": difference.mean(),
        "difference_stderr": difference.std(ddof=1) / math.sqrt(n),
      }
    )
  )


if __name__ == "__main__":
  app.run(main)
