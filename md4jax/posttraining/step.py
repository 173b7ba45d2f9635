"""The post-training update on a batch of rollouts: pure, one jitted program with the rollouts.

update(state, tokens, rewards, key) -> (state, metrics). Rows come in groups of
post_train.group_size (the rollouts of one prompt). With log π estimated by
post_train.likelihood, two estimates compared with each other share their draws:

  1. the KL's log-ratio, log π − log π_ref (the policy and the reference on one set of draws,
     of their own: from the gradient's draws it would bias the update, `objectives`), enters
     the reward as −β times it (β = 0: not estimated at all);
  2. the group advantages of those rewards (post_train.algorithm);
  3. post_train.updates_per_rollout optimizer steps on the clipped surrogate, the ratio
     π/π_rollout on the gradient's draws (at μ = 1 it is 1, and π_rollout is not estimated).
"""

import jax
import jax.numpy as jnp
import ml_collections
import optax

from md4jax.diffusion import log_likelihood
from md4jax.posttraining import objectives
from md4jax.training import objective, train
from md4jax.training import state as state_lib


def log_prob(
  params,
  key,
  tokens,
  editable,
  segment_ids=None,
  positions=None,
  *,
  model,
  config: ml_collections.ConfigDict,
):
  """post_train.likelihood's estimate of log π(tokens at editable | the rest) [N] under params;
  segment_ids and positions [N, L] (or None): the rows' padding, never attended to."""
  cfg = config.post_train
  return log_likelihood.log_likelihood(
    key,
    objective.sampling_denoiser(model, params, config, segment_ids, positions),
    tokens,
    mask_id=config.data.vocab_size,
    editable=editable,
    estimator=cfg.likelihood,
    draws=cfg.likelihood_draws,
    prompt_mask_prob=cfg.prompt_mask_prob,
  )


def apply_gradients(state, grads, frozen, optimizer, config) -> state_lib.TrainState:
  """state after one optimizer update with the trainable params' grads (frozen ones pass bit for
  bit), and its EMA moved toward the new params; the step unchanged."""
  full_grads = state_lib.join_trainable(grads, jax.tree.map(jnp.zeros_like, frozen))
  updates, opt_state = optimizer.update(full_grads, state.opt_state, state.params)
  trainable = state_lib.split_trainable(state.params, config)[0]
  trained = optax.apply_updates(trainable, state_lib.split_trainable(updates, config)[0])
  params = state_lib.join_trainable(trained, frozen)
  decay = train.ema_decay_at(state.step, config.optimizer.ema_decay, config.optimizer.ema_warmup)
  ema = jax.tree.map(lambda e, p: e + (1.0 - decay) * (p - e), state.ema_params, params)
  return state.replace(params=params, opt_state=opt_state, ema_params=ema)


def update(
  state: state_lib.TrainState,
  tokens: jax.Array,
  rewards: jax.Array,
  editable: jax.Array,
  key: jax.Array,
  segment_ids=None,
  positions=None,
  *,
  model,
  optimizer: optax.GradientTransformation,
  config: ml_collections.ConfigDict,
  reference_params,
) -> tuple[state_lib.TrainState, dict]:
  """The module docstring's update of state on rollouts tokens [N, L] (editable [N, L]: the
  positions the policy generated; segment_ids, positions: their padding) with rewards [N]."""
  cfg = config.post_train

  def estimate(params, draw_key):
    return log_prob(
      params, draw_key, tokens, editable, segment_ids, positions, model=model, config=config
    )

  shaping_key, draw_key = jax.random.split(key)
  updates_per_rollout = cfg.updates_per_rollout
  metrics = {"reward_mean": rewards.mean()}
  # The spread of the group means: the rollouts of one prompt are not independent draws.
  metrics["reward_group_std"] = rewards.reshape(-1, cfg.group_size).mean(-1).std()
  if cfg.beta > 0:  # β = 0: no KL, and no estimates spent on it.
    log_policy = estimate(state.params, shaping_key)
    log_ratio = log_policy - estimate(reference_params, shaping_key)
    # Per-sequence KL(π ‖ π_ref) ≈ E[log π − log π_ref] over the rollouts (estimated log π).
    metrics["kl"] = log_ratio.mean()
    rewards = objectives.regularized_rewards(rewards, log_ratio, 0.0, cfg.beta)
  advantages = objectives.group_advantages(
    rewards.reshape(-1, cfg.group_size), cfg.algorithm
  ).reshape(-1)
  # μ = 1: the ratio is 1 at the rollout's own params (its log π need not be estimated twice).
  log_rollout = None
  if updates_per_rollout > 1:
    log_rollout = jax.lax.stop_gradient(estimate(state.params, draw_key))

  def one_update(state, _):
    trainable, frozen = state_lib.split_trainable(state.params, config)

    def loss(trainable):
      log_now = estimate(state_lib.join_trainable(trainable, frozen), draw_key)
      old = jax.lax.stop_gradient(log_now) if log_rollout is None else log_rollout
      surrogate = objectives.clipped_objective(log_now, old, advantages, cfg.clip)
      return -surrogate.mean(), log_now

    (_, log_now), grads = jax.value_and_grad(loss, has_aux=True)(trainable)
    return apply_gradients(state, grads, frozen, optimizer, config), (
      optax.tree.norm(grads),
      log_now,
    )

  lr = state_lib.learning_rate_schedule(config, updates_per_rollout)
  metrics["learning_rate"] = lr(state.step * updates_per_rollout)
  state, (grad_norms, log_now) = jax.lax.scan(one_update, state, None, length=updates_per_rollout)
  state = state.replace(step=state.step + 1)
  metrics["grad_norm"] = grad_norms[-1]
  if cfg.beta > 0:
    # Two independent estimates of each log π at the rollout's params (the shaping draws', the
    # first update's): half their squared difference is the estimator's variance.
    metrics["likelihood_variance"] = 0.5 * jnp.mean((log_policy - log_now[0]) ** 2)
  return state, metrics


def preference_update(
  state: state_lib.TrainState,
  chosen: dict,
  rejected: dict,
  key: jax.Array,
  *,
  model,
  optimizer: optax.GradientTransformation,
  config: ml_collections.ConfigDict,
  reference_params,
) -> tuple[state_lib.TrainState, dict]:
  """DPO on a batch of pairs (rows of [prompt][response][EOS], `preferences`), with VRPO's
  shared draws: the policy and the reference score each response with the same times and masks
  (post_train.likelihood_draws of them), so the draws' noise mostly cancels in the margin."""
  cfg = config.post_train
  chosen_key, rejected_key = jax.random.split(key)

  def estimate(params, draw_key, rows):
    return log_prob(
      params,
      draw_key,
      rows["tokens"],
      rows["editable"],
      rows["segment_ids"],
      rows["positions"],
      model=model,
      config=config,
    )

  reference_chosen = estimate(reference_params, chosen_key, chosen)
  reference_rejected = estimate(reference_params, rejected_key, rejected)
  trainable, frozen = state_lib.split_trainable(state.params, config)

  def loss(trainable):
    params = state_lib.join_trainable(trainable, frozen)
    policy_chosen = estimate(params, chosen_key, chosen)
    policy_rejected = estimate(params, rejected_key, rejected)
    margin = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    losses = objectives.preference_loss(
      policy_chosen, policy_rejected, reference_chosen, reference_rejected, cfg.beta
    )
    return losses.mean(), margin

  (value, margin), grads = jax.value_and_grad(loss, has_aux=True)(trainable)
  new_state = apply_gradients(state, grads, frozen, optimizer, config)
  new_state = new_state.replace(step=state.step + 1)
  metrics = {
    "loss": value,
    "margin": margin.mean(),
    "preference_accuracy": (margin > 0).mean(),
    "grad_norm": optax.tree.norm(grads),
    "learning_rate": state_lib.learning_rate_schedule(config)(state.step),
  }
  return new_state, metrics
