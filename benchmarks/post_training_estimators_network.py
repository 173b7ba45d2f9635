r"""Which log π estimator to post-train a network with, at what cost: the estimator table on a
trained network of the generated language (`post_training_estimators.py` has it on the exact
oracle).

Trains the tiny config on the generated language (or reuses --dir/base), then for each
estimator (NELBO with K = 1, 4, 16 draws; d1's one step; coupled masks) post-trains it with
`--mode=post_train` (RLOO on a random normal bigram reward, β-KL to the base) for an equal
budget of denoiser calls in its log π estimates, budget / (calls per estimate) steps, once per
seed. Reports the trace of the gradient's covariance at the base params (over fresh rollouts
and draws) and, mean ± SE over the seeds, the samples' mean reward after the budget and the
total variation between their bigram frequencies and π*'s (exact, docs/math.md § 11), with the
base model's and π*'s. Seconds count each run's compilation. Prints JSON.

  python benchmarks/post_training_estimators_network.py --dir=/tmp/md4jax_estimators
"""

import json
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import md4jax
from md4jax import config as config_lib
from md4jax.app import modes, post_train
from md4jax.diffusion import optimum
from md4jax.posttraining import objectives
from md4jax.posttraining import step as step_lib

_DIR = flags.DEFINE_string("dir", "/tmp/md4jax_estimators", "Where the workdirs go.")
_BASE_STEPS = flags.DEFINE_integer("base_steps", 1000, "Training steps of the base model.")
_REUSE = flags.DEFINE_bool("reuse_base", False, "Reuse DIR/base and DIR/reward.npy.")
_BUDGET = flags.DEFINE_integer("budget", 320, "Denoiser calls per log π estimate, summed.")
_BETA = flags.DEFINE_float("beta", 2.0, "The KL coefficient.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Adam's peak learning rate.")
_GRADIENTS = flags.DEFINE_integer("gradients", 32, "Gradients drawn to measure the variance.")
_SAMPLES = flags.DEFINE_integer("samples", 2048, "Samples per model scored.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Post-training runs per estimator (config.seed).")

# (label, post_train.likelihood, post_train.likelihood_draws, denoiser calls per estimate)
RUNS = (
  ("nelbo K=1", "nelbo", 1, 1),
  ("nelbo K=4", "nelbo", 4, 4),
  ("nelbo K=16", "nelbo", 16, 16),
  ("d1", "d1", 1, 1),
  ("coupled", "coupled", 1, 2),
)
GROUPS, GROUP_SIZE, SAMPLER_STEPS = 8, 8, 16


def _base(root: pathlib.Path) -> None:
  shutil.rmtree(root / "base", ignore_errors=True)
  config = config_lib.load_config("tiny")
  config.num_train_steps = config.eval_every_steps = _BASE_STEPS.value
  config.checkpoint_every_steps = config.log_every_steps = _BASE_STEPS.value
  config.eval.discrete_steps, config.eval.profile_bins = "", 0
  config.sample.num_samples = 0
  modes.train_and_evaluate(config, root / "base")
  vocab = config.data.vocab_size
  np.save(root / "reward.npy", np.random.default_rng(0).normal(size=(vocab, vocab)))


def _post_config(root: pathlib.Path, likelihood: str, draws: int, steps: int, seed: int):
  config = config_lib.load_config("tiny")
  config.seed = seed  # The rollouts' and draws' stream.
  config.batch_size = GROUPS  # Unprompted rows, each rolled out GROUP_SIZE times.
  config.num_train_steps = config.checkpoint_every_steps = steps
  config.log_every_steps = max(1, steps // 4)
  config.optimizer.update(learning_rate=_LEARNING_RATE.value, warmup_steps=1, ema_decay=0.0)
  config.sample.update(num_samples=0, num_steps=SAMPLER_STEPS)
  config.post_train.update(
    init_from=str(root / "base"),
    reward=f"bigram:{root / 'reward.npy'}",
    algorithm="rloo",
    beta=_BETA.value,
    group_size=GROUP_SIZE,
    likelihood=likelihood,
    likelihood_draws=draws,
  )
  return config


def _scores(workdir, reward: np.ndarray, target) -> dict:
  """Fresh samples' mean reward ± SE and the bigram distance to π*."""
  loaded = md4jax.load(workdir)
  tokens, _ = md4jax.sample(
    jax.random.PRNGKey(1),
    loaded.denoise_fn,
    batch_size=_SAMPLES.value,
    length=loaded.config.data.seq_len,
    schedule=loaded.schedule,
    mask_id=loaded.mask_id,
    num_steps=loaded.config.data.seq_len,
  )
  tokens = np.asarray(tokens)
  scores = reward[tokens[:, :-1], tokens[:, 1:]].sum(-1)
  return {
    "reward_mean": float(scores.mean()),
    "reward_stderr": float(scores.std(ddof=1) / np.sqrt(len(scores))),
    "bigram_tv_to_optimum": optimum.bigram_distance(tokens, target),
  }


def _gradient_variance(loaded, reward: np.ndarray, likelihood: str, draws: int):
  """Trace of the covariance of the update's gradient at the base params (the policy is the
  reference there, so the KL term is 0), over fresh rollouts and estimator draws."""
  config = loaded.config.copy_and_resolve_references()
  config.post_train.update(likelihood=likelihood, likelihood_draws=draws)
  length, rows = loaded.config.data.seq_len, GROUPS * GROUP_SIZE
  table = jnp.asarray(reward, jnp.float32)

  @jax.jit
  def gradient(key):
    rollout_key, draw_key = jax.random.split(key)
    tokens, _ = md4jax.sample(
      rollout_key,
      loaded.denoise_fn,
      batch_size=rows,
      length=length,
      schedule=loaded.schedule,
      mask_id=loaded.mask_id,
      num_steps=SAMPLER_STEPS,
    )
    rewards = table[tokens[:, :-1], tokens[:, 1:]].sum(-1)
    advantages = objectives.group_advantages(rewards.reshape(-1, GROUP_SIZE), "rloo").reshape(-1)
    editable = jnp.ones(tokens.shape, bool)

    def surrogate(params):
      log_policy = step_lib.log_prob(
        params, draw_key, tokens, editable, model=loaded.model, config=config
      )
      return jnp.mean(advantages * log_policy)

    grads = jax.grad(surrogate)(loaded.params)
    return jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])

  keys = jax.random.split(jax.random.PRNGKey(2), _GRADIENTS.value)
  grads = np.stack([np.asarray(gradient(k), np.float64) for k in keys])
  return float(grads.var(0, ddof=1).sum())


def _summary(values) -> dict:
  """Mean ± SE over the seeds' runs."""
  values = np.asarray(values, np.float64)
  return {"mean": float(values.mean()), "stderr": float(values.std(ddof=1) / np.sqrt(len(values)))}


def main(argv):
  del argv
  root = pathlib.Path(_DIR.value)
  if not _REUSE.value:
    _base(root)
  reward = np.load(root / "reward.npy")
  base = md4jax.load(root / "base")
  language, length = base.language, base.config.data.seq_len
  target, _ = optimum.kl_optimum(language, reward, _BETA.value, length)
  report = {
    "beta": _BETA.value,
    "budget_calls": _BUDGET.value,
    "rollouts_per_step": GROUPS * GROUP_SIZE,
    "base": _scores(root / "base", reward, target),
    "optimum": {
      "reward_mean": target.expected_reward(reward),
      "kl_to_language": target.kl_to(language),
    },
    "estimators": {},
  }
  for label, likelihood, draws, calls in RUNS:
    steps = _BUDGET.value // calls
    runs = []
    for seed in range(_SEEDS.value):
      workdir = root / f"{label.replace(' ', '_').replace('=', '')}_seed{seed}"
      shutil.rmtree(workdir, ignore_errors=True)
      started = time.perf_counter()
      post_train.post_train(_post_config(root, likelihood, draws, steps, seed), workdir)
      runs.append({"seconds": time.perf_counter() - started, **_scores(workdir, reward, target)})
    report["estimators"][label] = {
      "calls_per_estimate": calls,
      "steps": steps,
      "gradient_variance": _gradient_variance(base, reward, likelihood, draws),
      **{
        name: _summary([run[name] for run in runs])
        for name in ("reward_mean", "bigram_tv_to_optimum", "seconds")
      },
    }
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
