"""A policy whose post-training can be read against the exact optimum: a Markov chain.

Its params are logits of a start law and a transition matrix; its denoiser is the chain's exact
posterior (`groundtruth.chain_posterior_logits`), so every sequence log-likelihood estimator is
applied to a masked denoiser whose true log π(x) is known, and the KL-regularised objective
E_π[r] − β KL(π ‖ p) of the chain after any number of updates is exact (`optimum`). The tests
and benchmarks/post_training_estimators.py post-train it with a bigram reward.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from md4jax.diffusion import groundtruth, log_likelihood, optimum
from md4jax.posttraining import objectives

# "exact" scores log π(x) itself: the estimators' common target.
ESTIMATORS = ("exact",) + log_likelihood.ESTIMATORS


def params_of(language: groundtruth.MarkovLanguage) -> dict:
  """The chain's params (float32 log-probabilities) that are the language itself."""
  return {
    "initial": jnp.log(jnp.asarray(language.initial, jnp.float32)),
    "transition": jnp.log(jnp.asarray(language.transition, jnp.float32)),
  }


def laws(params) -> tuple:
  """(start law [V], transition [V, V]) of the params."""
  return jax.nn.softmax(params["initial"]), jax.nn.softmax(params["transition"], axis=-1)


def sample(params, key, rows: int, length: int) -> jax.Array:
  """rows sequences [rows, length] of the chain."""
  initial, transition = laws(params)
  first_key, rest_key = jax.random.split(key)
  first = jax.random.categorical(first_key, jnp.log(initial), shape=(rows,))

  def step(token, step_key):
    token = jax.random.categorical(step_key, jnp.log(transition[token]))
    return token, token

  _, rest = jax.lax.scan(step, first, jax.random.split(rest_key, length - 1))
  return jnp.concatenate([first[:, None], rest.T], axis=1)


def log_prob(params, key, x, estimator: str, draws: int = 1) -> jax.Array:
  """log π(x) [B] of the chain: exactly, or as an estimator of it sees the chain's denoiser."""
  initial, transition = laws(params)
  if estimator == "exact":
    return jnp.log(initial)[x[:, 0]] + jnp.log(transition)[x[:, :-1], x[:, 1:]].sum(-1)
  vocab = transition.shape[-1]

  def denoise(z, alpha):
    del alpha  # The posterior given z does not depend on time.
    return groundtruth.chain_posterior_logits(z, initial, transition, vocab)

  return log_likelihood.log_likelihood(
    key,
    denoise,
    x,
    mask_id=vocab,
    editable=jnp.ones(x.shape, bool),
    estimator=estimator,
    draws=draws,
  )


def regularized_objective(params, language, reward, beta: float, length: int) -> float:
  """E_π[r] − β KL(π ‖ p) of the chain, exactly (float64)."""
  chain = _positional(params, length)
  return chain.expected_reward(reward) - beta * chain.kl_to(language)


def bigram_distance(params, chain: optimum.PositionalChain) -> float:
  """Total variation between the policy's and `chain`'s bigram frequencies (docs/math.md § 11)."""
  ours = _positional(params, chain.length).bigram_frequencies()
  return float(0.5 * np.abs(ours - chain.bigram_frequencies()).sum())


def _positional(params, length: int) -> optimum.PositionalChain:
  initial, transition = (np.asarray(law, np.float64) for law in laws(params))
  vocab = initial.shape[0]
  return optimum.PositionalChain(initial, np.broadcast_to(transition, (length - 1, vocab, vocab)))


@functools.partial(
  jax.jit,
  static_argnames=(
    "optimizer",
    "algorithm",
    "estimator",
    "draws",
    "groups",
    "group_size",
    "length",
    "shared_shaping",
  ),
)
def update(
  params,
  opt_state,
  key,
  reference,
  reward,
  beta,
  *,
  optimizer: optax.GradientTransformation,
  algorithm: str,
  estimator: str,
  draws: int,
  groups: int,
  group_size: int,
  length: int,
  shared_shaping: bool = False,
):
  """One on-policy update: groups × group_size rollouts, the bigram reward less β times the
  estimated log-ratio to the reference, group advantages, the clipped surrogate's gradient.

  shared_shaping=True estimates the log-ratio from the gradient's own draws (the biased way,
  kept to measure it). Returns (params, opt_state, gradient as one flat vector).
  """
  rollout_key, shaping_key, draw_key = jax.random.split(key, 3)
  if shared_shaping:
    shaping_key = draw_key
  x = sample(params, rollout_key, groups * group_size, length)
  rewards = reward[x[:, :-1], x[:, 1:]].sum(-1)
  log_ratio = log_prob(params, shaping_key, x, estimator, draws) - log_prob(
    reference, shaping_key, x, estimator, draws
  )
  shaped = objectives.regularized_rewards(rewards, log_ratio, 0.0, beta)
  advantages = objectives.group_advantages(shaped.reshape(groups, group_size), algorithm)
  log_rollout = log_prob(params, draw_key, x, estimator, draws)

  def loss(p):
    surrogate = objectives.clipped_objective(
      log_prob(p, draw_key, x, estimator, draws), log_rollout, advantages.reshape(-1), 0.2
    )
    return -surrogate.mean()

  grads = jax.grad(loss)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  flat = jnp.concatenate([g.reshape(-1) for g in jax.tree.leaves(grads)])
  return optax.apply_updates(params, updates), opt_state, flat
