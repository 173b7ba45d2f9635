"""GenMD4: the NELBO of a state-dependent masking schedule and the gradient of its exponents.

A state-dependent schedule gives each clean value v its own survival α_v(t)
(`schedules.TokenPolynomial`: α_v = 1 − t^{w_v}); position ℓ is masked with
probability 1 − α_{x_ℓ}(t). The posterior of a hidden token then depends on t,
so the denoiser is called as denoise_fn(z_t, t) with the time t [B].

The continuous-time bound (MD4, Shi et al. 2024, Sec. 6 "generalization to
state-dependent masking", their ELBO for GenMD4). In docs/math.md's notation, with
μ = p_θ(· | z_t, t) and b_v(t) = −α′_v(t) / (1 − α_v(t)) ≥ 0 (= w_v / t), the
reverse process unmasks a masked position to v at rate b_v μ_v, while given x
the true reverse rate is b_x into x only. The continuous-time ELBO of a Markov
jump process charges, per masked position, Σ_v R_θ(v) − R_q + R_q log(R_q / R_θ(x)):

  L∞ = ∫_0^1 E_{q(z_t | x)} Σ_{ℓ masked} [ b_x(t) (−log μ_x) − b_x(t) + Σ_v b_v(t) μ_v ] dt.

With one shared b the last two
terms cancel and it is w(t) · CE. Each bracket is ≥ 0 and is 0 at μ = δ_x.

Truncation and reconstruction, as MD4 does at small t: the integral runs over
t ∈ [ε, 1] (t = ε + (1 − ε) u, weight 1 − ε) and the reverse process from z_ε
reveals every remaining mask in one step (α_v(0) = 1), which costs exactly
E_{z_ε}[Σ_{ℓ masked} −log μ_{x_ℓ}(z_ε, ε)]. This is still an upper bound on
−log p(x) (a valid, slightly coarser model at t < ε), not a clipped weight.

Discrete time T (grid t_i = i/T, s = t_{i−1}): a masked position is revealed
as v with prob μ_v r_v, r_v = (α_v(s) − α_v(t)) / (1 − α_v(t)), and stays
masked with prob M = Σ_v μ_v (1 − r_v). The KL to the true step is
r_x (−log μ_x) + (1 − r_x) log((1 − r_x) / M); L_T sums it over steps.

Gradient of the exponents: which positions are masked depends on w, so
∇_w E_q[f] = E[∇_w f] + E[f ∇_w log q(z_t | x)]. `surrogate` draws two
corruptions per sequence at the same t; with "rloo" each is the other's
baseline (REINFORCE leave-one-out, unbiased since the draws are independent
given x and t), with "score" there is no baseline (for comparison). The
surrogate's value equals the unbiased NELBO draw; only its gradient differs.
"""

from typing import Optional

import jax
import jax.numpy as jnp

from md4jax.diffusion import masking

Array = jax.Array
GRADIENTS = ("rloo", "score")


def position_mask_prob(schedule, t: Array, x: Array) -> Array:
  """1 − α_{x_ℓ}(t) of every position, [B, L], for times t [B]."""
  return jnp.take_along_axis(schedule.mask_prob(t), x, axis=-1)


def corrupt(
  key: Array, x: Array, schedule, t: Array, *, mask_id: int, editable: Array
) -> tuple[Array, Array]:
  """z_t ~ q(z_t | x) of a state-dependent schedule, and log q(z_t | x) per sequence [B]."""
  mask_prob = position_mask_prob(schedule, t, x)
  z = masking.corrupt(key, x, 1.0 - mask_prob, mask_id=mask_id, editable=editable)
  masked = z == mask_id
  # The visible branch never sees mask_prob = 1 (t = 1 masks everything), so no log(0) or NaN grad.
  log_visible = jnp.log1p(-jnp.where(masked, 0.5, mask_prob))
  log_q = jnp.where(masked, jnp.log(jnp.where(masked, mask_prob, 1.0)), log_visible)
  return z, jnp.where(editable, log_q, 0.0).sum(-1)


def _rates(schedule, t: Array, x: Array) -> tuple[Array, Array]:
  """b_v(t) [B, 1, V] and b_{x_ℓ}(t) [B, L]."""
  rates = schedule.weight(t)[:, None, :]
  return rates, jnp.take_along_axis(
    jnp.broadcast_to(rates, x.shape + rates.shape[-1:]), x[..., None], axis=-1
  )[..., 0]


def continuous_integrand(
  logits: Array, x: Array, z_t: Array, schedule, t: Array, *, mask_id: int
) -> Array:
  """Σ_{ℓ masked} b_x (−log μ_x) − b_x + Σ_v b_v μ_v at times t [B], per sequence [B]."""
  masking.check_vocab(logits, mask_id)
  rates, own_rate = _rates(schedule, t, x)
  expected_rate = jnp.sum(jax.nn.softmax(logits.astype(jnp.float32), axis=-1) * rates, axis=-1)
  per_position = own_rate * masking.cross_entropy(logits, x) - own_rate + expected_rate
  return jnp.where(z_t == mask_id, per_position, 0.0).sum(-1)


def _continuous_draw(keys, denoise_fn, x, schedule, u, editable, *, mask_id, reconstruction_time):
  """One draw of the truncated bound plus its reconstruction term: (nats [B], log q [B])."""
  main_key, recon_key = keys
  eps = reconstruction_time
  t = eps + (1.0 - eps) * u
  z_t, log_q = corrupt(main_key, x, schedule, t, mask_id=mask_id, editable=editable)
  nats = (1.0 - eps) * continuous_integrand(
    denoise_fn(z_t, t), x, z_t, schedule, t, mask_id=mask_id
  )
  if eps > 0:
    t_eps = jnp.full_like(u, eps)
    z_eps, log_q_eps = corrupt(recon_key, x, schedule, t_eps, mask_id=mask_id, editable=editable)
    # At small ε z_ε is usually all visible: then the term is exactly 0 and the call is skipped.
    nats += jax.lax.cond(
      jnp.any(z_eps == mask_id),
      lambda: masking.masked_cross_entropy(denoise_fn(z_eps, t_eps), x, z_eps, mask_id=mask_id).sum(
        -1
      ),
      lambda: jnp.zeros(x.shape[:1], jnp.float32),
    )
    log_q += log_q_eps
  return nats, log_q


def _discrete_draw(key, denoise_fn, x, schedule, u, editable, *, mask_id, num_steps):
  """T × the KL of one uniformly drawn step i of the T-step bound, per sequence [B]."""
  step = jnp.clip(jnp.ceil(u * num_steps), 1, num_steps)
  t, s = step / num_steps, (step - 1) / num_steps
  z_t, _ = corrupt(key, x, schedule, t, mask_id=mask_id, editable=editable)
  logits = denoise_fn(z_t, t)
  masking.check_vocab(logits, mask_id)
  stay = schedule.mask_prob(s) / schedule.mask_prob(t)  # 1 − r_v, [B, V]; 0 on the last step.
  own_stay = jnp.take_along_axis(stay, x, axis=-1)  # [B, L]
  stay_prob = jnp.einsum("blv,bv->bl", jax.nn.softmax(logits.astype(jnp.float32), axis=-1), stay)
  kept = own_stay * (jnp.log(jnp.maximum(own_stay, 1e-30)) - jnp.log(jnp.maximum(stay_prob, 1e-30)))
  per_position = (1.0 - own_stay) * masking.cross_entropy(logits, x) + jnp.where(
    own_stay > 0, kept, 0.0
  )
  return num_steps * jnp.where(z_t == mask_id, per_position, 0.0).sum(-1)


def nelbo(
  keys: tuple,
  denoise_fn,
  x: Array,
  schedule,
  u: Array,
  editable: Array,
  *,
  mask_id: int,
  num_steps: Optional[int] = None,
  reconstruction_time: float = 1e-4,
) -> Array:
  """One draw of the state-dependent NELBO per sequence [B] from times u [B] in (0, 1].

  `keys` = (main, reconstruction), each one key per row (`masking.row_keys`);
  `md4jax.diffusion.bounds.nelbo` prepares them and calls this for state-dependent
  schedules. The main corruption uses the same draws as a mask-rate schedule's.
  The discrete-time bound (num_steps) needs no reconstruction_time: its grid
  reaches t = 0.
  """
  if num_steps is not None:
    return _discrete_draw(
      keys[0], denoise_fn, x, schedule, u, editable, mask_id=mask_id, num_steps=num_steps
    )
  return _continuous_draw(
    keys,
    denoise_fn,
    x,
    schedule,
    u,
    editable,
    mask_id=mask_id,
    reconstruction_time=reconstruction_time,
  )[0]


def surrogate(
  key: Array,
  denoise_fn,
  x: Array,
  schedule,
  u: Array,
  editable: Array,
  *,
  mask_id: int,
  gradient: str = "rloo",
  reconstruction_time: float = 1e-4,
) -> tuple[Array, Array]:
  """(nats [B], surrogate [B]): two draws' mean NELBO, and a loss whose gradient also holds the
  score-function term for the schedule's parameters. Equal in value; differentiate the second.

  "score" also draws twice (no baseline), so the two estimators cost the same and their
  variances compare draw for draw.
  """
  if gradient not in GRADIENTS:
    raise ValueError(f"Unknown schedule gradient {gradient!r}; valid: {', '.join(GRADIENTS)}.")
  draws = [
    _continuous_draw(
      masking.split_keys(k, 2),
      denoise_fn,
      x,
      schedule,
      u,
      editable,
      mask_id=mask_id,
      reconstruction_time=reconstruction_time,
    )
    for k in masking.split_keys(key, 2)
  ]
  losses = []
  for index, (nats, log_q) in enumerate(draws):
    baseline = draws[1 - index][0] if gradient == "rloo" else 0.0
    coefficient = jax.lax.stop_gradient(nats - baseline)
    losses.append(nats + coefficient * (log_q - jax.lax.stop_gradient(log_q)))
  return (draws[0][0] + draws[1][0]) / 2, (losses[0] + losses[1]) / 2
