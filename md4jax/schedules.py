"""Masking schedules α(t): the probability that a token is still visible at time t.

Every schedule is a frozen dataclass with pure, jit-able methods over arrays:
`alpha(t)`, `mask_prob(t)` = 1 − α(t) (computed without cancellation),
`dalpha(t)` = α′(t) (analytic) and `weight(t)` = −α′(t) / (1 − α(t)).

Endpoints. The continuous-time NELBO depends on a schedule only through its
endpoints (MATH.md, "Invariance"). Each schedule states `alpha_at_0` and
`alpha_at_1` exactly, as Python floats:
  * α(0) < 1 means some tokens are already masked at t = 0, so the bound needs a
    reconstruction term for them;
  * α(1) > 0 means some tokens are still visible at t = 1, so the all-mask prior
    does not match q(z_1 | x) and the bound needs a prior term.
`md4jax.diffusion.nelbo` adds both terms whenever a schedule needs them.
"""

import abc
import dataclasses
import math
from typing import Callable

import jax.numpy as jnp

Array = jnp.ndarray


class Schedule(abc.ABC):
  """Base class: subclasses define `alpha`, `dalpha` and, where not (1, 0), the endpoints."""

  name: str = ""
  alpha_at_0: float = 1.0
  alpha_at_1: float = 0.0

  @abc.abstractmethod
  def alpha(self, t: Array) -> Array:
    """α(t), the probability that a token is still visible at time t."""

  def mask_prob(self, t: Array) -> Array:
    """1 − α(t); overridden where a direct formula avoids cancellation near t = 0."""
    return 1.0 - self.alpha(t)

  @abc.abstractmethod
  def dalpha(self, t: Array) -> Array:
    """α′(t), analytic."""

  def weight(self, t: Array) -> Array:
    """w(t) = −α′(t) / (1 − α(t)), the continuous-time NELBO weight."""
    return -self.dalpha(t) / self.mask_prob(t)

  @property
  def needs_reconstruction_term(self) -> bool:
    return self.alpha_at_0 < 1.0

  @property
  def needs_prior_term(self) -> bool:
    return self.alpha_at_1 > 0.0


@dataclasses.dataclass(frozen=True)
class Linear(Schedule):
  """α(t) = 1 − t. Endpoints α(0) = 1, α(1) = 0 (no endpoint terms); w(t) = 1/t."""

  name = "linear"

  def alpha(self, t):
    return 1.0 - t

  def mask_prob(self, t):
    return jnp.asarray(t) * 1.0

  def dalpha(self, t):
    return -jnp.ones_like(jnp.asarray(t, dtype=jnp.result_type(float)))


@dataclasses.dataclass(frozen=True)
class Polynomial(Schedule):
  """α(t) = 1 − t^K. Endpoints α(0) = 1, α(1) = 0 (no endpoint terms); w(t) = K/t."""

  power: float = 2.0

  def __post_init__(self):
    if not self.power > 0:
      raise ValueError(f"Polynomial schedule needs power > 0, got {self.power}.")

  @property
  def name(self):
    return f"poly{self.power:g}"

  def alpha(self, t):
    return 1.0 - jnp.power(t, self.power)

  def mask_prob(self, t):
    return jnp.power(t, self.power)

  def dalpha(self, t):
    return -self.power * jnp.power(t, self.power - 1.0)

  def weight(self, t):
    return self.power / t  # K t^(K−1) / t^K, simplified so t → 0 does not divide 0 by 0.


@dataclasses.dataclass(frozen=True)
class Cosine(Schedule):
  """MD4's α(t) = 1 − cos(π/2 · (1 − t)) = 1 − sin(π t / 2).

  Endpoints α(0) = 1, α(1) = 0 exactly (no endpoint terms); w(t) = (π/2) / tan(π t / 2).
  cos(π t / 2) is written sin(π (1 − t) / 2) so that it is exactly 0 at t = 1.
  """

  name = "cosine"

  def alpha(self, t):
    return 1.0 - jnp.sin(0.5 * jnp.pi * t)

  def mask_prob(self, t):
    return jnp.sin(0.5 * jnp.pi * t)

  def dalpha(self, t):
    return -0.5 * jnp.pi * jnp.sin(0.5 * jnp.pi * (1.0 - t))


@dataclasses.dataclass(frozen=True)
class LogLinear(Schedule):
  """MDLM's α(t) = 1 − (1 − ε) t; w(t) = 1/t.

  Endpoints α(0) = 1, α(1) = ε > 0: a fraction ε of tokens is still visible at
  t = 1, so the bound includes a prior term (see `md4jax.diffusion`).
  """

  eps: float = 1e-3

  name = "loglinear"

  def __post_init__(self):
    if not 0.0 <= self.eps < 1.0:
      raise ValueError(f"LogLinear schedule needs 0 <= eps < 1, got {self.eps}.")

  @property
  def alpha_at_1(self):
    return float(self.eps)

  def alpha(self, t):
    return self.eps + (1.0 - self.eps) * (1.0 - t)  # Exactly ε at t = 1.

  def mask_prob(self, t):
    return (1.0 - self.eps) * jnp.asarray(t)

  def dalpha(self, t):
    return -(1.0 - self.eps) * jnp.ones_like(jnp.asarray(t, dtype=jnp.result_type(float)))

  def weight(self, t):
    return 1.0 / t


@dataclasses.dataclass(frozen=True)
class Geometric(Schedule):
  """SEDD's α(t) = exp(−σ̄(t)), σ̄(t) = σmin^(1−t) σmax^t.

  Endpoints α(0) = exp(−σmin) < 1 and α(1) = exp(−σmax) > 0, so the bound
  includes both a reconstruction and a prior term.
  """

  sigma_min: float = 1e-4
  sigma_max: float = 20.0

  name = "geometric"

  def __post_init__(self):
    if not 0.0 < self.sigma_min < self.sigma_max:
      raise ValueError(
          f"Geometric schedule needs 0 < sigma_min < sigma_max, got {self.sigma_min}, {self.sigma_max}.")

  @property
  def alpha_at_0(self):
    return math.exp(-self.sigma_min)

  @property
  def alpha_at_1(self):
    return math.exp(-self.sigma_max)

  def _sigma_bar(self, t):
    return self.sigma_min ** (1.0 - t) * self.sigma_max ** t

  def alpha(self, t):
    return jnp.exp(-self._sigma_bar(t))

  def mask_prob(self, t):
    return -jnp.expm1(-self._sigma_bar(t))

  def dalpha(self, t):
    sigma_bar = self._sigma_bar(t)
    return -jnp.exp(-sigma_bar) * sigma_bar * math.log(self.sigma_max / self.sigma_min)


def _polynomial_from_name(name: str, **kwargs) -> Schedule:
  power = name[len("poly"):]
  try:
    return Polynomial(power=float(power), **kwargs)
  except ValueError as e:
    raise ValueError(f"Cannot read the power of schedule {name!r}: {e}") from None


_REGISTRY: dict[str, Callable[..., Schedule]] = {
    "linear": Linear,
    "cosine": Cosine,
    "loglinear": LogLinear,
    "geometric": Geometric,
}
VALID_NAMES = tuple(sorted(_REGISTRY)) + ("polyK (poly2, poly3, any K > 0)",)


def get_schedule(name: str, **kwargs) -> Schedule:
  """Returns the schedule called `name` (e.g. "linear", "cosine", "poly3")."""
  if name in _REGISTRY:
    return _REGISTRY[name](**kwargs)
  if name.startswith("poly") and name != "poly":
    return _polynomial_from_name(name, **kwargs)
  raise ValueError(f"Unknown schedule {name!r}; valid schedules: {', '.join(VALID_NAMES)}.")
