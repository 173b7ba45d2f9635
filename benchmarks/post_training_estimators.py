r"""Which sequence log-likelihood estimator to post-train with, at what cost: on the exact oracle.

The policy is a Markov chain whose denoiser is its exact posterior (`posttraining.chain_policy`),
post-trained with RLOO on a bigram reward with a β-KL to the base language. For each estimator
of log π (exact; NELBO with K = 1, 4, 16 draws; d1's one step; coupled masks) at an equal
budget of denoiser calls, it reports the gradient's variance at the base policy, and after the
budget: the share of the gap in E[r] − β KL(π ‖ p) to π* closed (π* exact, docs/math.md § 11),
the bigram distance to π*, and the same with the KL's log-ratio taken from the gradient's own
draws. Each estimator's log π(x) of the language's sequences, the language's own posterior the
denoiser, against the exact log π(x): its mean error (bias), the spread of that error over
sequences, and its variance per estimate and per call. Then VRPO's variance reduction: the
variance of the DPO loss's estimate on pairs with the policy's and the reference's draws
shared, against independent draws.

  python benchmarks/post_training_estimators.py > /tmp/estimators.json
"""

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from md4jax.diffusion import groundtruth, optimum
from md4jax.posttraining import chain_policy, objectives

_VOCAB = flags.DEFINE_integer("vocab_size", 3, "The language's tokens.")
_LENGTH = flags.DEFINE_integer("length", 6, "Tokens per sequence.")
_BETA = flags.DEFINE_float("beta", 0.5, "The KL coefficient.")
_BUDGET = flags.DEFINE_integer("budget", 8000, "Denoiser calls per log π estimate, summed.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Languages and rewards (one run each).")
_GRADIENTS = flags.DEFINE_integer("gradients", 200, "Gradients drawn to measure the variance.")
_PAIRS = flags.DEFINE_integer("pairs", 64, "Preference pairs for VRPO's variance.")
_SEQUENCES = flags.DEFINE_integer("sequences", 64, "Sequences whose log π estimates are scored.")
_REPEATS = flags.DEFINE_integer("repeats", 200, "Estimates of each sequence's log π.")
_LIKELIHOOD_ONLY = flags.DEFINE_bool(
  "likelihood_only", False, "Only the log π estimates against the exact one."
)

# (label, estimator, draws, the KL's log-ratio from the gradient's own draws)
RUNS = (
  ("exact", "exact", 1, False),
  ("nelbo K=1", "nelbo", 1, False),
  ("nelbo K=4", "nelbo", 4, False),
  ("nelbo K=16", "nelbo", 16, False),
  ("d1", "d1", 1, False),
  ("coupled", "coupled", 1, False),
  ("nelbo K=1, shared shaping draws", "nelbo", 1, True),
)
GROUPS, GROUP_SIZE, LEARNING_RATE = 8, 8, 0.03


def calls_per_estimate(estimator: str, draws: int) -> int:
  """Denoiser calls of one log π estimate (exact counts as one)."""
  return {"exact": 1, "nelbo": draws, "d1": 1, "coupled": 2 * draws}[estimator]


def _arguments(estimator, draws, shared):
  return dict(
    algorithm="rloo",
    estimator=estimator,
    draws=draws,
    groups=GROUPS,
    group_size=GROUP_SIZE,
    length=_LENGTH.value,
    shared_shaping=shared,
  )


def _gradient_variance(reference, reward, estimator, draws, shared) -> float:
  """Trace of the gradient's covariance at the base policy, over fresh rollouts and draws."""
  optimizer = optax.sgd(0.0)
  state = optimizer.init(reference)
  grads = [
    chain_policy.update(
      reference,
      state,
      key,
      reference,
      reward,
      _BETA.value,
      optimizer=optimizer,
      **_arguments(estimator, draws, shared),
    )[2]
    for key in jax.random.split(jax.random.PRNGKey(1), _GRADIENTS.value)
  ]
  return float(np.asarray(grads).var(0, ddof=1).sum())


def _post_train(language, reward, target, log_z, estimator, draws, shared) -> dict:
  reference = chain_policy.params_of(language)
  reward32 = jnp.asarray(reward, jnp.float32)
  optimizer = optax.adam(LEARNING_RATE)
  params, opt_state = reference, optimizer.init(reference)
  updates = _BUDGET.value // calls_per_estimate(estimator, draws)
  started = time.perf_counter()
  for key in jax.random.split(jax.random.PRNGKey(0), updates):
    params, opt_state, _ = chain_policy.update(
      params,
      opt_state,
      key,
      reference,
      reward32,
      _BETA.value,
      optimizer=optimizer,
      **_arguments(estimator, draws, shared),
    )
  jax.block_until_ready(params)
  seconds = time.perf_counter() - started
  base = chain_policy.regularized_objective(reference, language, reward, _BETA.value, _LENGTH.value)
  value = chain_policy.regularized_objective(params, language, reward, _BETA.value, _LENGTH.value)
  best = _BETA.value * log_z
  return {
    "updates": updates,
    "gap_closed": (value - base) / (best - base),
    "bigram_distance": chain_policy.bigram_distance(params, target),
    "base_bigram_distance": chain_policy.bigram_distance(reference, target),
    "gradient_variance": _gradient_variance(reference, reward32, estimator, draws, shared),
    "seconds": seconds,
  }


def _likelihood_errors(language, seed: int) -> dict:
  """Each estimator's log p(x) of sequences of the language, its own exact posterior the
  denoiser, against the exact log p(x): per estimator, the errors of the mean of the draws
  [sequences] and the variance of one estimate per sequence [sequences]."""
  params = chain_policy.params_of(language)
  seed_key = jax.random.PRNGKey(seed)
  x = language.sample(jax.random.fold_in(seed_key, 1), _SEQUENCES.value, _LENGTH.value)
  exact = np.asarray(chain_policy.log_prob(params, None, x, "exact"), np.float64)
  keys = jax.random.split(jax.random.fold_in(seed_key, 2), _REPEATS.value)
  result = {}
  for label, estimator, draws, shared in RUNS:
    if estimator == "exact" or shared:
      continue
    estimate = jax.jit(
      functools.partial(chain_policy.log_prob, params, x=x, estimator=estimator, draws=draws)
    )
    values = np.stack([np.asarray(estimate(k), np.float64) for k in keys])  # [draws, sequences]
    result[label] = {
      "calls": calls_per_estimate(estimator, draws),
      "errors": values.mean(0) - exact,
      "variances": values.var(0, ddof=1),
    }
  return result


def _vrpo_variance(language, seed: int) -> dict:
  """Variance of the DPO loss's estimate (NELBO, one draw) per pair: shared vs independent draws
  for the policy and the reference; the policy is the base chain with perturbed transitions."""
  reference = chain_policy.params_of(language)
  noise = jax.random.normal(jax.random.PRNGKey(seed), reference["transition"].shape)
  policy = {**reference, "transition": reference["transition"] + 0.3 * noise}
  length, rows = _LENGTH.value, _PAIRS.value
  chosen = language.sample(jax.random.PRNGKey(10 + seed), rows, length)
  rejected = language.sample(jax.random.PRNGKey(20 + seed), rows, length)

  @jax.jit
  def loss(key, shared):
    policy_key, reference_key = jax.random.split(key)
    reference_key = jnp.where(shared, policy_key, reference_key)

    def score(params, draw_key, x):
      return chain_policy.log_prob(params, draw_key, x, "nelbo")

    return objectives.preference_loss(
      score(policy, policy_key, chosen),
      score(policy, jax.random.fold_in(policy_key, 1), rejected),
      score(reference, reference_key, chosen),
      score(reference, jax.random.fold_in(reference_key, 1), rejected),
      1.0,
    )

  keys = jax.random.split(jax.random.PRNGKey(seed), 400)
  result = {}
  for name, shared in (("shared", True), ("independent", False)):
    losses = np.asarray([loss(k, shared) for k in keys])  # [draws, pairs]
    result[name] = float(losses.var(0, ddof=1).mean())
  exact = objectives.preference_loss(
    *(
      chain_policy.log_prob(params, None, x, "exact")
      for params, x in (
        (policy, chosen),
        (policy, rejected),
        (reference, chosen),
        (reference, rejected),
      )
    ),
    1.0,
  )
  result["exact_mean_loss"] = float(np.mean(exact))
  return result


def _summary(values) -> dict:
  values = np.asarray(values, np.float64)
  return {"mean": float(values.mean()), "stderr": float(values.std(ddof=1) / np.sqrt(len(values)))}


def _likelihood_table(errors: list) -> dict:
  """Per estimator, pooled over the seeds' sequences: the mean error ± SE; the SD over sequences
  of each one's own error (its estimate's noise over the repeats taken out); the variance of
  one estimate, and that times the calls it costs."""
  table = {}
  for label in errors[0]:
    mean_errors = np.concatenate([e[label]["errors"] for e in errors])
    variance = float(np.mean([e[label]["variances"] for e in errors]))
    spread = max(0.0, mean_errors.var(ddof=1) - variance / _REPEATS.value)
    table[label] = {
      "bias": _summary(mean_errors),
      "bias_spread_over_sequences": float(np.sqrt(spread)),
      "variance": variance,
      "variance_times_calls": variance * errors[0][label]["calls"],
    }
  return table


def main(argv):
  del argv
  runs = {label: [] for label, *_ in RUNS}
  vrpo, errors = [], []
  for seed in range(_SEEDS.value):
    language = groundtruth.MarkovLanguage(_VOCAB.value, seed=seed, concentration=1.0)
    reward = np.random.default_rng(seed).normal(size=(_VOCAB.value, _VOCAB.value))
    target, log_z = optimum.kl_optimum(language, reward, _BETA.value, _LENGTH.value)
    errors.append(_likelihood_errors(language, seed))
    if _LIKELIHOOD_ONLY.value:
      continue
    for label, estimator, draws, shared in RUNS:
      runs[label].append(_post_train(language, reward, target, log_z, estimator, draws, shared))
    vrpo.append(_vrpo_variance(language, seed))
  report = {
    "vocab_size": _VOCAB.value,
    "length": _LENGTH.value,
    "seeds": _SEEDS.value,
    "log_likelihood_against_exact": _likelihood_table(errors),
  }
  if not _LIKELIHOOD_ONLY.value:
    report.update(
      beta=_BETA.value,
      budget_calls=_BUDGET.value,
      rollouts_per_update=GROUPS * GROUP_SIZE,
      base_bigram_distance=_summary([r["base_bigram_distance"] for r in runs["exact"]]),
      estimators={
        label: {
          "calls_per_estimate": calls_per_estimate(estimator, draws),
          "updates": results[0]["updates"],
          **{
            metric: _summary([r[metric] for r in results])
            for metric in ("gap_closed", "bigram_distance", "gradient_variance", "seconds")
          },
        }
        for (label, estimator, draws, _), results in zip(RUNS, runs.values())
      },
      vrpo_loss_variance={
        name: _summary([v[name] for v in vrpo])
        for name in ("shared", "independent", "exact_mean_loss")
      },
    )
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
