"""The Gaussian side of the uniform-state process (DUO's diffusion duality; docs/math.md § 16).

Take w = ν e_x + ε with ε ~ N(0, I_V) and z = argmax w. By symmetry z = x with probability

  I(ν) = E_{u ~ N(0, 1)} [Φ(u + ν)^(V − 1)]

and each other token with probability (1 − I)/(V − 1), so z is a draw of the uniform-state
process q_t(· | x) = α e_x + (1 − α)/V exactly when α = (V·I(ν) − 1)/(V − 1).
`Duality` tabulates that map once (float64 quadrature on the host) and inverts it by
interpolation; `coupled_states` draws z_t and z_s from one ε, a coupling of the process at two
times (each marginal exact) under which z_s is a deterministic function of (x, ε) and the
time: the trajectories DUO's consistency distillation reads.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

from md4jax.diffusion import masking

Array = jax.Array
NU_MAX = 40.0  # ν where α = 1 is taken: P(z ≠ x) < V · Φ(−28) there, far below float32's ulp.


def argmax_probability(nu, vocab_size: int, num_nodes: int = 8001) -> np.ndarray:
  """I(ν) = P(argmax(ν e_x + ε) = x) for an array of ν >= 0, float64 (trapezoid in u over
  [−12, 12], the integrand φ(u) Φ(u + ν)^(V − 1) evaluated in logs)."""
  nu = np.asarray(nu, np.float64)
  u = np.linspace(-12.0, 12.0, num_nodes)
  log_phi = -0.5 * u**2 - 0.5 * np.log(2 * np.pi)
  log_integrand = log_phi + (vocab_size - 1) * special.log_ndtr(u + nu[..., None])
  return np.trapezoid(np.exp(log_integrand), u, axis=-1)


@dataclasses.dataclass(frozen=True)
class Duality:
  """α(ν) of a vocabulary on a grid of ν, and its inverse ν(α) by interpolation."""

  vocab_size: int
  nu_grid: tuple
  alpha_grid: tuple

  @classmethod
  def of(cls, vocab_size: int, num_points: int = 2049) -> "Duality":
    # Denser where α moves fastest (small ν), and ν = NU_MAX at the end (α = 1).
    nu = NU_MAX * np.linspace(0.0, 1.0, num_points) ** 2
    alpha = (vocab_size * argmax_probability(nu, vocab_size) - 1.0) / (vocab_size - 1.0)
    alpha = np.maximum.accumulate(np.clip(alpha, 0.0, 1.0))  # Monotone despite rounding.
    alpha[0], alpha[-1] = 0.0, 1.0
    return cls(vocab_size, tuple(nu.tolist()), tuple(alpha.tolist()))

  def nu(self, alpha: Array) -> Array:
    """ν(α): the Gaussian signal whose argmax keeps x with the uniform process's α."""
    return jnp.interp(alpha, jnp.asarray(self.alpha_grid), jnp.asarray(self.nu_grid))

  def alpha(self, nu: Array) -> Array:
    return jnp.interp(nu, jnp.asarray(self.nu_grid), jnp.asarray(self.alpha_grid))


def coupled_states(key, x: Array, nu_t: Array, nu_s: Array, vocab_size: int, editable=None):
  """(z_t, z_s) [B, L]: argmax(ν e_x + ε) at ν_t and ν_s [B] with one ε ~ N(0, I_V) per editable
  position (the others keep x). key: one key (row b from fold_in(key, b)) or one per row."""
  keys = masking.row_keys(key, x.shape[0])
  noise = jax.vmap(lambda k: jax.random.normal(k, (*x.shape[1:], vocab_size)))(keys)
  signal = jax.nn.one_hot(x, vocab_size, dtype=noise.dtype)
  z_t = jnp.argmax(nu_t[:, None, None] * signal + noise, axis=-1).astype(x.dtype)
  z_s = jnp.argmax(nu_s[:, None, None] * signal + noise, axis=-1).astype(x.dtype)
  if editable is not None:
    z_t, z_s = jnp.where(editable, z_t, x), jnp.where(editable, z_s, x)
  return z_t, z_s


@functools.lru_cache(maxsize=8)
def of(vocab_size: int) -> Duality:
  """The vocabulary's `Duality`, tabulated once per process."""
  return Duality.of(vocab_size)
