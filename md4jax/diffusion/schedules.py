"""Masking schedules α(t): the probability that a token is still visible at time t.

Every schedule is a frozen dataclass with pure, jit-able methods over arrays:
`alpha(t)`, `mask_prob(t)` = 1 − α(t) (computed without cancellation),
`dalpha(t)` = α′(t) (analytic), `weight(t)` = −α′(t) / (1 − α(t)) and, for a
mask-rate schedule, its inverse `time_of(alpha)` (a denoiser conditioned on t
rather than on α, `md4jax.training.objective.denoiser`).

Endpoints. The continuous-time NELBO depends on a schedule only through its
endpoints (docs/math.md, "Schedules"). Each schedule states `alpha_at_0` and
`alpha_at_1` exactly, as Python floats:
  * α(0) < 1 means some tokens are already masked at t = 0, so the bound needs a
    reconstruction term for them;
  * α(1) > 0 means some tokens are still visible at t = 1, so the all-mask prior
    does not match q(z_1 | x) and the bound needs a prior term.
`md4jax.diffusion.bounds.nelbo` adds both terms whenever a schedule needs them (or,
with endpoint_terms="md4", MD4's constant reconstruction term and no prior term).

State-dependent schedules (GenMD4, `TokenPolynomial`): each clean token value v
has its own α_v(t); their methods return [..., V] for times [...], and their
`state_dependent` is True. The bound, the sampler and the exact posterior then
need the time t itself (docs/math.md, "GenMD4").
"""

import abc
import dataclasses
import functools
import math
from typing import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray


def _checks_times(method):
  """The method's `t` must be float times (checked at trace time, naming the method)."""

  @functools.wraps(method)
  def checked(self, t):
    chex.assert_type(
      t,
      float,
      custom_message=f"{type(self).__name__}.{method.__name__}(t): t must be float times in [0, 1]",
    )
    return method(self, t)

  return checked


class Schedule(abc.ABC):
  """Base class: subclasses define `alpha`, `dalpha` and, where not (1, 0), the endpoints."""

  name: str = ""
  alpha_at_0: float = 1.0
  alpha_at_1: float = 0.0
  state_dependent: bool = False  # True: methods return one value per clean token, [..., V].

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    for method in ("alpha", "mask_prob", "dalpha", "weight"):
      if method in cls.__dict__:
        setattr(cls, method, _checks_times(cls.__dict__[method]))

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

  def time_of(self, alpha: Array) -> Array:
    """The time t with α(t) = alpha, clipped to [0, 1] (alpha past an endpoint: that endpoint's t)."""
    return jnp.clip(self._inverse(jnp.asarray(alpha)), 0.0, 1.0)

  def _inverse(self, alpha: Array) -> Array:
    """α⁻¹, unclipped; every mask-rate schedule overrides it."""
    raise ValueError(
      f"{type(self).__name__} has no single inverse α⁻¹: its α(t) is per token, so a "
      "t-conditioned denoiser must be given t itself (model.time_input='alpha' or a mask-rate "
      "schedule)."
    )

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

  def _inverse(self, alpha):
    return 1.0 - alpha


@dataclasses.dataclass(frozen=True)
class MD4Linear(Schedule):
  """MD4's linear schedule α(t) = (1 − 2ε)(1 − t) + ε, ε = 1e-4 (md4/models/diffusion/md4.py).

  Endpoints α(0) = 1 − ε < 1 and α(1) = ε > 0: both endpoint terms; MD4 itself adds a
  constant reconstruction term and no prior term (config.diffusion.endpoint_terms = "md4").
  w(t) = (1 − 2ε) / ((1 − 2ε) t + ε), at most (1 − 2ε)/ε at t = 0.
  """

  eps: float = 1e-4

  name = "md4linear"

  def __post_init__(self):
    if not 0.0 <= self.eps < 0.5:
      raise ValueError(f"MD4Linear schedule needs 0 <= eps < 0.5, got {self.eps}.")

  @property
  def alpha_at_0(self):
    return 1.0 - self.eps

  @property
  def alpha_at_1(self):
    return float(self.eps)

  def alpha(self, t):
    return (1.0 - 2.0 * self.eps) * (1.0 - t) + self.eps

  def mask_prob(self, t):
    return (1.0 - 2.0 * self.eps) * jnp.asarray(t) + self.eps

  def dalpha(self, t):
    return -(1.0 - 2.0 * self.eps) * jnp.ones_like(jnp.asarray(t, dtype=jnp.result_type(float)))

  def _inverse(self, alpha):
    return (1.0 - self.eps - alpha) / (1.0 - 2.0 * self.eps)


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

  def _inverse(self, alpha):
    return jnp.power(1.0 - alpha, 1.0 / self.power)


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

  def _inverse(self, alpha):
    return jnp.arcsin(jnp.clip(1.0 - alpha, -1.0, 1.0)) / (0.5 * jnp.pi)


@dataclasses.dataclass(frozen=True)
class LogLinear(Schedule):
  """MDLM's α(t) = 1 − (1 − ε) t; w(t) = 1/t.

  Endpoints α(0) = 1, α(1) = ε > 0: a fraction ε of tokens is still visible at
  t = 1, so the bound includes a prior term (see `md4jax.diffusion.bounds`).
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

  def _inverse(self, alpha):
    return (1.0 - alpha) / (1.0 - self.eps)


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
        f"Geometric schedule needs 0 < sigma_min < sigma_max, got {self.sigma_min}, {self.sigma_max}."
      )

  @property
  def alpha_at_0(self):
    return math.exp(-self.sigma_min)

  @property
  def alpha_at_1(self):
    return math.exp(-self.sigma_max)

  def _sigma_bar(self, t):
    return self.sigma_min ** (1.0 - t) * self.sigma_max**t

  def alpha(self, t):
    return jnp.exp(-self._sigma_bar(t))

  def mask_prob(self, t):
    return -jnp.expm1(-self._sigma_bar(t))

  def dalpha(self, t):
    sigma_bar = self._sigma_bar(t)
    return -jnp.exp(-sigma_bar) * sigma_bar * math.log(self.sigma_max / self.sigma_min)

  def _inverse(self, alpha):
    # log σ̄ is linear in t; α = 1 gives −inf and α = 0 +inf, both clipped by time_of.
    return (jnp.log(-jnp.log(alpha)) - math.log(self.sigma_min)) / math.log(
      self.sigma_max / self.sigma_min
    )


@dataclasses.dataclass(frozen=True, eq=False)
class TokenPolynomial(Schedule):
  """GenMD4's per-token α_v(t) = 1 − t^{w_v}: token value v masked with prob t^{w_v}.

  `exponents` w is a positive [V] array (traced or concrete: a learned schedule
  is rebuilt from its parameters inside the jitted step). Methods map times
  [...] to [..., V]; a_v(t) = α′_v / (1 − α_v) = −w_v / t, so `weight` is w_v / t.
  With all w_v = K it is `Polynomial(K)` token for token. Endpoints α_v(0) = 1,
  α_v(1) = 0 for every v (no endpoint terms).
  """

  exponents: Array = None

  name = "tokenpoly"
  state_dependent = True

  def __post_init__(self):
    w = self.exponents
    if w is None or jnp.ndim(w) != 1:
      raise ValueError(
        "TokenPolynomial schedule needs exponents, a positive [V] array, got "
        f"{None if w is None else jnp.shape(w)}."
      )
    if not isinstance(w, jax.core.Tracer) and not np.all(np.asarray(w) > 0):
      raise ValueError("TokenPolynomial schedule needs every exponent > 0.")

  def _power(self, t):
    return jnp.power(jnp.asarray(t)[..., None], self.exponents)

  def alpha(self, t):
    return 1.0 - self._power(t)

  def mask_prob(self, t):
    return self._power(t)

  def dalpha(self, t):
    t = jnp.asarray(t)[..., None]
    return -self.exponents * jnp.power(t, self.exponents - 1.0)

  def weight(self, t):
    return self.exponents / jnp.asarray(t)[..., None]


def _polynomial_from_name(name: str, **kwargs) -> Schedule:
  power = name[len("poly") :]
  try:
    return Polynomial(power=float(power), **kwargs)
  except ValueError as e:
    raise ValueError(f"Cannot read the power of schedule {name!r}: {e}") from None


_REGISTRY: dict[str, Callable[..., Schedule]] = {
  "linear": Linear,
  "md4linear": MD4Linear,
  "cosine": Cosine,
  "loglinear": LogLinear,
  "geometric": Geometric,
  "tokenpoly": TokenPolynomial,
}
VALID_NAMES = tuple(sorted(_REGISTRY)) + ("polyK (poly2, poly3, any K > 0)",)
# Names whose exponents are learned with the model (config.diffusion.schedule).
LEARNED_NAMES = ("learned_tokenpoly", "learned_poly")


def get_schedule(name: str, **kwargs) -> Schedule:
  """Returns the schedule called `name` (e.g. "linear", "cosine", "poly3", "tokenpoly")."""
  if name in _REGISTRY:
    return _REGISTRY[name](**kwargs)
  if name.startswith("poly") and name != "poly":
    return _polynomial_from_name(name, **kwargs)
  raise ValueError(f"Unknown schedule {name!r}; valid schedules: {', '.join(VALID_NAMES)}.")
