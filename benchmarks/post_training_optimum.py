r"""A post-trained model against the exact KL-regularised optimum π* of a bigram reward.

For workdirs trained on the generated language (data.dataset "markov"): fresh samples of the
base model and of the post-trained one, their mean reward ± SE and the total variation between
their bigram frequencies (a first-order chain fitted to the samples) and π*'s; the same exact
figures for the language itself and for π* (docs/math.md § 11). Prints JSON.

  python benchmarks/post_training_optimum.py --base=/tmp/md4jax_default \
      --post=/tmp/md4jax_post_train --reward=/tmp/reward.npy --beta=0.5
"""

import json

import jax
import numpy as np
from absl import app, flags

import md4jax
from md4jax.diffusion import optimum

_BASE = flags.DEFINE_string("base", None, "The workdir post-training started from.")
_POST = flags.DEFINE_string("post", None, "The post-trained workdir.")
_REWARD = flags.DEFINE_string("reward", None, "The [V, V] bigram reward table (.npy).")
_BETA = flags.DEFINE_float("beta", None, "post_train.beta of the run.")
_SAMPLES = flags.DEFINE_integer("samples", 2048, "Samples per model.")
_STEPS = flags.DEFINE_integer("num_steps", 0, "Sampler steps (ancestral); 0 = the length.")
flags.mark_flags_as_required(["base", "post", "reward", "beta"])


def main(argv):
  del argv
  reward = np.load(_REWARD.value)
  loaded = {
    name: md4jax.load(path) for name, path in (("base", _BASE.value), ("post", _POST.value))
  }
  language = loaded["base"].language
  if language is None:
    raise ValueError(f"{_BASE.value} was not trained on the generated language (data.markov).")
  length, vocab = loaded["base"].config.data.seq_len, language.vocab_size
  target, log_z = optimum.kl_optimum(language, reward, _BETA.value, length)
  report = {"beta": _BETA.value, "length": length, "samples": _SAMPLES.value}
  for name, model in loaded.items():
    tokens, _ = md4jax.sample(
      jax.random.PRNGKey(1),
      model.denoise_fn,
      batch_size=_SAMPLES.value,
      length=length,
      schedule=model.schedule,
      mask_id=vocab,
      num_steps=_STEPS.value or length,
    )
    tokens = np.asarray(tokens)
    scores = reward[tokens[:, :-1], tokens[:, 1:]].sum(-1)
    report[name] = {
      "step": model.step,
      "reward_mean": float(scores.mean()),
      "reward_stderr": float(scores.std(ddof=1) / np.sqrt(len(scores))),
      "bigram_tv_to_optimum": optimum.bigram_distance(tokens, target),
    }
  chain = optimum.PositionalChain(
    language.initial, np.broadcast_to(language.transition, (length - 1, vocab, vocab))
  )
  report["language"] = {
    "reward_mean": chain.expected_reward(reward),
    "bigram_tv_to_optimum": float(
      0.5 * np.abs(chain.bigram_frequencies() - target.bigram_frequencies()).sum()
    ),
  }
  report["optimum"] = {
    "reward_mean": target.expected_reward(reward),
    "kl_to_language": target.kl_to(language),
    "objective": _BETA.value * log_z,
  }
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
