r"""Each sampler's exact-law excess against its network calls, with the exact denoiser, as JSON.

  python benchmarks/sampler_law.py
  python benchmarks/sampler_law.py --num_samples=1024 --steps=4,16,64,256,1000 --thresholds=0.5,0.9

On the generated language of configs/default.py (its vocabulary, length and
seed), the denoiser is the exact posterior, so a sampler's excess is its own
error: mean −log2 p(sample) per token minus the true entropy per token, ± SE
over samples (0 for an exact sampler). Also NFE (network calls for the batch)
and seconds (after one compile run).
"""

import json
import math
import time

import jax
import numpy as np
from absl import app, flags

from md4jax import config as config_lib
from md4jax.diffusion import groundtruth, schedules
from md4jax.sampling import decoder

_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 512, "Samples per point (one batch).")
_STEPS = flags.DEFINE_list("steps", ["4", "16", "64", "256", "1000"], "T of the grid methods.")
_METHODS = flags.DEFINE_list(
  "methods",
  ["ancestral", "jump", "first_hitting", "confidence", "threshold"],
  "Samplers to compare.",
)
_THRESHOLDS = flags.DEFINE_list(
  "thresholds", ["0.5", "0.7", "0.9", "0.99"], "Thresholds of 'threshold'."
)


def main(argv):
  del argv
  config = config_lib.load_config("default")
  vocab_size, length = config.data.vocab_size, config.data.seq_len
  language = groundtruth.MarkovLanguage(
    vocab_size, seed=config.data.language_seed, concentration=config.data.concentration
  )
  entropy_bits = language.entropy(length) / (length * math.log(2.0))
  schedule = schedules.get_schedule(config.diffusion.schedule)
  points = []
  for method in _METHODS.value:
    if method == "first_hitting":
      variants = [{}]
    elif method == "threshold":
      variants = [{"threshold": float(h)} for h in _THRESHOLDS.value]
    else:
      variants = [{"num_steps": int(s)} for s in _STEPS.value]
    for variant in variants:
      run = jax.jit(
        lambda key, variant=variant, method=method: decoder.sample(
          key,
          language.denoise_fn(vocab_size),
          batch_size=_NUM_SAMPLES.value,
          length=length,
          schedule=schedule,
          mask_id=vocab_size,
          method=method,
          **variant,
        )
      )
      jax.block_until_ready(run(jax.random.PRNGKey(0)))
      start = time.perf_counter()
      tokens, info = run(jax.random.PRNGKey(1))
      tokens = np.asarray(tokens)
      seconds = time.perf_counter() - start
      bits = -np.asarray(language.log_prob(tokens), np.float64) / (length * math.log(2.0))
      points.append(
        {
          "method": method,
          **variant,
          "nfe": int(info["nfe"]),
          "seconds": seconds,
          "excess_bits_per_token": float(bits.mean() - entropy_bits),
          "excess_stderr": float(bits.std(ddof=1) / math.sqrt(bits.size)),
        }
      )
  print(
    json.dumps(
      {
        "vocab_size": vocab_size,
        "length": length,
        "num_samples": _NUM_SAMPLES.value,
        "true_bits_per_token": entropy_bits,
        "points": points,
      },
      indent=2,
    )
  )


if __name__ == "__main__":
  app.run(main)
