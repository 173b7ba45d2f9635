"""The post-training objectives over per-sequence log-likelihood estimates: pure functions.

A rollout group holds G completions of one prompt. With log π(x) estimated by
`md4jax.diffusion.log_likelihood` (the same draws for the policy, the rollout policy and the
reference), the policy-gradient algorithms maximize

  E_π[r(x)] − β KL(π ‖ π_ref)

(docs/math.md § 11: its optimum is π* ∝ π_ref exp(r/β)). The KL enters the reward as
−β (log π − log π_ref), held constant under the gradient: then E[(r − β log π/π_ref) ∇log π]
is that objective's exact gradient (the −β E[∇log π] left over is 0), as no loss-side KL
estimate's gradient is. With estimates of log π, the KL's log-ratio must come from draws
independent of those the gradient differentiates: from the same draws its noise ε correlates
with ∇ε, and the updates also descend β Var(ε)/2 (on the exact oracle, RLOO with one NELBO
draw then closes 0.75 of the gap to π* instead of 0.97: docs/post_training.md).
"""

import jax
import jax.numpy as jnp

ADVANTAGES = ("grpo", "dr_grpo", "rloo")
# post_train.algorithm: a policy-gradient one (its advantages), or DPO on pairs with VRPO's draws.
ALGORITHMS = ADVANTAGES + ("vrpo",)
# The std of a group of equal rewards is 0: GRPO divides by std + this (as d1 and TRL do).
_STD_EPSILON = 1e-4


def group_advantages(rewards: jax.Array, algorithm: str) -> jax.Array:
  """Advantages [P, G] of rewards [P, G] (P prompts, G completions each).

  grpo: (r − group mean) / (group std + ε); dr_grpo: r − group mean (Dr. GRPO: no std
  scaling, which favours groups of nearly equal rewards); rloo: r − the mean of the other G − 1
  (an unbiased baseline: G/(G − 1) times dr_grpo's).
  """
  if algorithm not in ADVANTAGES:
    raise ValueError(f"Unknown algorithm {algorithm!r}; valid: {', '.join(ADVANTAGES)}.")
  groups = rewards.shape[-1]
  centred = rewards - rewards.mean(-1, keepdims=True)
  if algorithm == "grpo":
    return centred / (rewards.std(-1, keepdims=True) + _STD_EPSILON)
  if algorithm == "rloo":
    if groups < 2:
      raise ValueError("rloo needs groups of at least 2 completions.")
    return centred * groups / (groups - 1)
  return centred


def regularized_rewards(rewards, log_policy, log_reference, beta: float) -> jax.Array:
  """r − β (log π − log π_ref), with no gradient: the KL-regularised objective's reward."""
  return jax.lax.stop_gradient(rewards - beta * (log_policy - log_reference))


def clipped_objective(log_policy, log_rollout, advantages, clip: float) -> jax.Array:
  """PPO's clipped surrogate per sequence, min(ρ A, clip(ρ, 1 − ε, 1 + ε) A), ρ = π/π_rollout.

  At the rollout's own params ρ = 1 and its gradient is A ∇log π: REINFORCE with the advantage.
  """
  ratio = jnp.exp(log_policy - jax.lax.stop_gradient(log_rollout))
  return jnp.minimum(ratio * advantages, jnp.clip(ratio, 1.0 - clip, 1.0 + clip) * advantages)


def preference_loss(
  policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta: float
) -> jax.Array:
  """DPO's loss per pair, −log σ(β [(log π − log π_ref)(chosen) − (log π − log π_ref)(rejected)]).

  VRPO scores each of the four terms with the same draws (times and masks) for the policy and
  the reference, so their differences carry little of the estimator's noise."""
  margin = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
  return -jax.nn.log_sigmoid(beta * margin)
