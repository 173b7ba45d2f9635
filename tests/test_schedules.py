"""Tests of md4jax.diffusion.schedules: endpoints, derivatives, weights, registry, jit.

Reference values are the closed forms of docs/MATH.md ("Schedules"), computed
in float64 NumPy. Float32 tolerances: values in [0, 1] are compared with an
absolute tolerance of a few ulp(1) ≈ 6e-8 (a float32 `1 − x` cannot do better),
derivatives/weights with a relative tolerance of a few hundred ulp (they pass
through sin/pow/exp, each good to a few ulp, plus the rounding of t itself).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate

from md4jax.diffusion import schedules
from md4jax.diffusion.schedules import get_schedule

NAMES = ["linear", "cosine", "poly2", "poly3", "poly0.5", "loglinear", "geometric", "md4linear"]
MD4_EPS = 1e-4

# MATH.md table: exact endpoints (α(0), α(1)) for the default parameters.
EXPECTED_ENDPOINTS = {
  "linear": (1.0, 0.0),
  "cosine": (1.0, 0.0),
  "poly2": (1.0, 0.0),
  "poly3": (1.0, 0.0),
  "poly0.5": (1.0, 0.0),
  "loglinear": (1.0, 1e-3),
  "geometric": (math.exp(-1e-4), math.exp(-20.0)),
  "md4linear": (1.0 - MD4_EPS, MD4_EPS),
}

# Grid in (0, 1]: log-spaced near 0, then uniform up to 1 (both ends included).
GRID = np.unique(np.concatenate([np.geomspace(1e-6, 1e-2, 25), np.linspace(1e-2, 1.0, 100)]))
SMALL_T = np.array([1e-7, 1e-4, 1.0])

# float32 tolerances (see module docstring).
ATOL32_UNIT = 4e-7  # absolute, for quantities in [0, 1] (~ 7 ulp(1))
RTOL32 = 2e-5  # relative, for derivatives and weights (~ 170 ulp)
# float64 tolerances.
RTOL64 = 1e-12
ATOL64_UNIT = 1e-14


def _closed_form(name, t):
  """(α, −α′, w) from MATH.md, float64 NumPy, default parameters (w(0) = inf)."""
  with np.errstate(divide="ignore"):
    return _closed_form_impl(name, np.asarray(t, np.float64))


def _closed_form_impl(name, t):
  if name == "linear":
    return 1 - t, np.ones_like(t), 1 / t
  if name.startswith("poly"):
    k = float(name[4:])
    return 1 - t**k, k * t ** (k - 1), k / t
  if name == "cosine":
    c = np.cos(np.pi / 2 * (1 - t))
    s = np.sin(np.pi / 2 * (1 - t))
    return 1 - c, np.pi / 2 * s, (np.pi / 2) / np.tan(np.pi * t / 2)
  if name == "loglinear":
    eps = 1e-3
    return 1 - (1 - eps) * t, np.full_like(t, 1 - eps), 1 / t
  if name == "geometric":
    smin, smax = 1e-4, 20.0
    sbar = smin ** (1 - t) * smax**t
    a = np.exp(-sbar)
    minus_da = a * sbar * np.log(smax / smin)
    return a, minus_da, minus_da / -np.expm1(-sbar)
  if name == "md4linear":
    slope = 1 - 2 * MD4_EPS
    return slope * (1 - t) + MD4_EPS, np.full_like(t, slope), slope / (slope * t + MD4_EPS)
  raise AssertionError(name)


def _mask_prob_ref(name, t):
  """1 − α(t) in float64 written without cancellation."""
  t = np.asarray(t, np.float64)
  if name == "linear":
    return t
  if name.startswith("poly"):
    return t ** float(name[4:])
  if name == "cosine":
    return np.sin(np.pi * t / 2)
  if name == "loglinear":
    return (1 - 1e-3) * t
  if name == "geometric":
    return -np.expm1(-(1e-4 ** (1 - t) * 20.0**t))
  if name == "md4linear":
    return (1 - 2 * MD4_EPS) * t + MD4_EPS
  raise AssertionError(name)


# ---------------------------------------------------------------- endpoints
@pytest.mark.parametrize("name", NAMES)
def test_endpoints_match_documented_values(name):
  s = get_schedule(name)
  a0, a1 = EXPECTED_ENDPOINTS[name]
  # The attributes are exact Python floats.
  assert isinstance(s.alpha_at_0, float) and isinstance(s.alpha_at_1, float)
  assert s.alpha_at_0 == pytest.approx(a0, rel=1e-15, abs=0)
  assert s.alpha_at_1 == pytest.approx(a1, rel=1e-15, abs=0)
  # float32 evaluation of α agrees with them (absolute tolerance: α ∈ [0, 1]).
  np.testing.assert_allclose(
    float(s.alpha(jnp.float32(0.0))), s.alpha_at_0, rtol=1e-6, atol=ATOL32_UNIT
  )
  np.testing.assert_allclose(
    float(s.alpha(jnp.float32(1.0))), s.alpha_at_1, rtol=1e-6, atol=ATOL32_UNIT
  )
  # float64 evaluation agrees tightly, also in relative terms (α(1) = 2e-9 for geometric).
  with jax.enable_x64(True):
    np.testing.assert_allclose(float(s.alpha(jnp.float64(0.0))), s.alpha_at_0, rtol=RTOL64, atol=0)
    np.testing.assert_allclose(
      float(s.alpha(jnp.float64(1.0))), s.alpha_at_1, rtol=RTOL64, atol=1e-300
    )


@pytest.mark.parametrize("name", NAMES)
def test_endpoint_term_flags(name):
  s = get_schedule(name)
  assert s.needs_reconstruction_term == (s.alpha_at_0 < 1.0)
  assert s.needs_prior_term == (s.alpha_at_1 > 0.0)
  expected = {"geometric": (True, True), "loglinear": (False, True), "md4linear": (True, True)}.get(
    name, (False, False)
  )
  assert (s.needs_reconstruction_term, s.needs_prior_term) == expected


# ---------------------------------------------------------------- values
@pytest.mark.parametrize("name", NAMES)
def test_alpha_matches_closed_form(name):
  s = get_schedule(name)
  t = np.concatenate([[0.0], GRID])
  a_ref, _, _ = _closed_form(name, t)
  np.testing.assert_allclose(
    np.asarray(s.alpha(jnp.asarray(t, jnp.float32))), a_ref, rtol=1e-6, atol=ATOL32_UNIT
  )
  with jax.enable_x64(True):
    np.testing.assert_allclose(
      np.asarray(s.alpha(jnp.asarray(t, jnp.float64))), a_ref, rtol=1e-12, atol=ATOL64_UNIT
    )


@pytest.mark.parametrize("name", NAMES)
def test_mask_prob_monotone_and_range(name):
  s = get_schedule(name)
  t = jnp.linspace(0.0, 1.0, 10001, dtype=jnp.float32)
  a = np.asarray(s.alpha(t))
  m = np.asarray(s.mask_prob(t))
  np.testing.assert_allclose(m, 1.0 - a, rtol=0, atol=ATOL32_UNIT)
  assert np.all(np.diff(a) <= 0), "alpha must be non-increasing in t"
  assert np.all(np.diff(m) >= 0), "mask_prob must be non-decreasing in t"
  assert np.all((a >= 0) & (a <= 1))
  assert np.all((m >= 0) & (m <= 1))
  # float64: mask_prob is accurate in relative terms too (no cancellation near t = 0).
  with jax.enable_x64(True):
    t64 = jnp.asarray(GRID, jnp.float64)
    np.testing.assert_allclose(np.asarray(s.mask_prob(t64)), _mask_prob_ref(name, GRID), rtol=1e-12)


# ---------------------------------------------------------------- derivatives
@pytest.mark.parametrize("name", NAMES)
def test_dalpha_matches_autodiff_float32(name):
  s = get_schedule(name)
  t = jnp.asarray(GRID, jnp.float32)
  analytic = np.asarray(s.dalpha(t))
  auto = np.asarray(jax.vmap(jax.grad(s.alpha))(t))
  assert analytic.dtype == np.float32
  # atol: cosine's autodiff derivative −(π/2)cos(πt/2) is off by ~π/2·ulp(1) near t = 1
  # (cancellation in cos near π/2), while the analytic sin(π(1−t)/2) form is exact.
  np.testing.assert_allclose(analytic, auto, rtol=RTOL32, atol=1e-6)
  # And both agree with the float64 closed form −α′.
  _, minus_da, _ = _closed_form(name, np.asarray(t, np.float64))
  np.testing.assert_allclose(-analytic, minus_da, rtol=RTOL32, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_dalpha_matches_autodiff_float64(name):
  s = get_schedule(name)
  with jax.enable_x64(True):
    t = jnp.asarray(GRID, jnp.float64)
    analytic = np.asarray(s.dalpha(t))
    auto = np.asarray(jax.vmap(jax.grad(s.alpha))(t))
    assert analytic.dtype == np.float64 and auto.dtype == np.float64
    np.testing.assert_allclose(analytic, auto, rtol=1e-10, atol=1e-14)
    _, minus_da, _ = _closed_form(name, GRID)
    np.testing.assert_allclose(-analytic, minus_da, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("name", NAMES)
def test_integral_of_minus_dalpha_is_endpoint_difference(name):
  """Invariance: ∫_0^1 −α′(t) dt = α(0) − α(1), with the library's float64 α′."""
  s = get_schedule(name)
  with jax.enable_x64(True):
    f = jax.jit(lambda t: -s.dalpha(t))
    value, err = integrate.quad(
      lambda t: float(f(jnp.float64(t))), 0.0, 1.0, epsabs=1e-12, epsrel=1e-10, limit=200
    )
  expected = s.alpha_at_0 - s.alpha_at_1
  assert err < 1e-8
  assert value == pytest.approx(expected, rel=1e-8, abs=max(10 * err, 1e-12))


# ---------------------------------------------------------------- weights
@pytest.mark.parametrize("name", NAMES)
def test_weight_definition_and_closed_form(name):
  s = get_schedule(name)
  # Definition, float64, away from 0 (1 − α has no cancellation problem there).
  t_away = GRID[GRID >= 0.05]
  with jax.enable_x64(True):
    t64 = jnp.asarray(t_away, jnp.float64)
    w = np.asarray(s.weight(t64))
    defn = np.asarray(-s.dalpha(t64) / (1.0 - s.alpha(t64)))
    np.testing.assert_allclose(w, defn, rtol=1e-9, atol=1e-14)
    # Closed forms of MATH.md on the whole grid, float64.
    _, _, w_ref = _closed_form(name, GRID)
    np.testing.assert_allclose(
      np.asarray(s.weight(jnp.asarray(GRID, jnp.float64))), w_ref, rtol=1e-10, atol=1e-14
    )
  # float32 weight agrees with the float64 closed form everywhere on the grid.
  t32 = jnp.asarray(GRID, jnp.float32)
  _, _, w_ref32 = _closed_form(name, np.asarray(t32, np.float64))
  np.testing.assert_allclose(np.asarray(s.weight(t32)), w_ref32, rtol=RTOL32, atol=1e-6)


@pytest.mark.parametrize(
  "name", [n for n in NAMES if n != "geometric"]
)  # geometric: no simple form
def test_weight_simple_closed_forms(name):
  """The table's simple forms: linear/loglinear 1/t, polyK K/t, cosine (π/2)/tan(πt/2)."""
  s = get_schedule(name)
  t = GRID
  simple = {
    "linear": lambda t: 1 / t,
    "loglinear": lambda t: 1 / t,
    "poly2": lambda t: 2 / t,
    "poly3": lambda t: 3 / t,
    "poly0.5": lambda t: 0.5 / t,
    "cosine": lambda t: (np.pi / 2) / np.tan(np.pi * t / 2),
    "md4linear": lambda t: (1 - 2 * MD4_EPS) / ((1 - 2 * MD4_EPS) * t + MD4_EPS),
  }
  with jax.enable_x64(True):
    np.testing.assert_allclose(
      np.asarray(s.weight(jnp.asarray(t, jnp.float64))), simple[name](t), rtol=1e-10, atol=1e-14
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("x64", [False, True])
def test_weight_finite_nonnegative(name, x64):
  s = get_schedule(name)
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    t = jnp.asarray(np.concatenate([SMALL_T, GRID]), dtype)
    w = np.asarray(s.weight(t))
    assert w.dtype == np.dtype(dtype)
    assert np.all(np.isfinite(w)), w
    assert np.all(w >= 0), w
    # At t = 1e-7, w is large but of the right size (≈ 1/t · K, or ≈ 1/t for the others;
    # md4linear's is bounded by (1 − 2ε)/ε).
    w_small = float(s.weight(jnp.asarray(1e-7, dtype)))
    _, _, ref = _closed_form(name, np.float64(np.asarray(1e-7, dtype)))
    assert w_small == pytest.approx(float(ref), rel=1e-4)


# ---------------------------------------------------------------- inverse
@pytest.mark.parametrize("name", NAMES)
def test_time_of_inverts_alpha(name):
  """time_of(α(t)) = t (float64, to rounding), and α's outside [α(1), α(0)] clip to 0 or 1."""
  s = get_schedule(name)
  with jax.enable_x64(True):
    t = np.concatenate([[0.0], GRID[GRID >= 1e-3]])  # Below, α(t) rounds to α(0) for some.
    back = np.asarray(s.time_of(s.alpha(jnp.asarray(t, jnp.float64))))
    # cosine: arcsin's slope 1/√(1 − x²) magnifies rounding near t = 1.
    np.testing.assert_allclose(back, t, rtol=1e-6 if name == "cosine" else 1e-9, atol=1e-9)
    outside = np.asarray(s.time_of(jnp.asarray([1.0, 0.0], jnp.float64)))
  np.testing.assert_array_equal(outside, [0.0, 1.0])
  # float32: within a few ulp of α, magnified by 1/|α′(t)| (away from the flat ends).
  t32 = jnp.asarray(GRID[(GRID >= 0.05) & (GRID <= 0.95)], jnp.float32)
  np.testing.assert_allclose(np.asarray(s.time_of(s.alpha(t32))), np.asarray(t32), atol=2e-5)


def test_state_dependent_schedule_has_no_inverse():
  with pytest.raises(ValueError, match="per token"):
    get_schedule("tokenpoly", exponents=jnp.ones(3)).time_of(jnp.float32(0.5))


def test_md4linear_is_md4s_squeezed_linear_schedule():
  """α(t) = (1 − 2ε)(1 − t) + ε exactly at float32, as MD4 computes it; w(0) = (1 − 2ε)/ε."""
  s = get_schedule("md4linear")
  t = jnp.asarray(GRID, jnp.float32)
  np.testing.assert_array_equal(
    np.asarray(s.alpha(t)),
    np.float32(1 - 2 * MD4_EPS) * (np.float32(1) - np.asarray(t)) + np.float32(MD4_EPS),
  )
  assert float(s.weight(jnp.float32(0.0))) == pytest.approx((1 - 2 * MD4_EPS) / MD4_EPS, rel=1e-6)


# ---------------------------------------------------------------- registry
def test_get_schedule_unknown_lists_valid_names():
  with pytest.raises(ValueError, match="linear") as info:
    get_schedule("unknown")
  msg = str(info.value)
  for valid in ("linear", "cosine", "loglinear", "geometric", "poly"):
    assert valid in msg


@pytest.mark.parametrize("bad", ["polyabc", "poly", "poly-1", "poly0", "Linear", ""])
def test_get_schedule_bad_names_raise(bad):
  with pytest.raises(ValueError):
    get_schedule(bad)


def test_get_schedule_types_and_params():
  assert isinstance(get_schedule("linear"), schedules.Linear)
  assert isinstance(get_schedule("cosine"), schedules.Cosine)
  p5 = get_schedule("poly5")
  assert isinstance(p5, schedules.Polynomial) and p5.power == 5
  assert p5.name == "poly5"
  assert get_schedule("poly0.5").power == 0.5
  assert get_schedule("loglinear", eps=0.01).alpha_at_1 == 0.01
  g = get_schedule("geometric", sigma_min=1e-3, sigma_max=10.0)
  assert (g.sigma_min, g.sigma_max) == (1e-3, 10.0)
  assert g.alpha_at_0 == math.exp(-1e-3) and g.alpha_at_1 == math.exp(-10.0)
  for name in ["linear", "cosine", "loglinear", "geometric", "poly2", "poly3", "md4linear"]:
    assert get_schedule(name).name == name


@pytest.mark.parametrize(
  "make",
  [
    lambda: schedules.LogLinear(eps=1.5),
    lambda: schedules.LogLinear(eps=1.0),
    lambda: schedules.LogLinear(eps=-0.1),
    lambda: schedules.Geometric(sigma_min=20.0, sigma_max=20.0),
    lambda: schedules.Geometric(sigma_min=30.0, sigma_max=20.0),
    lambda: schedules.Geometric(sigma_min=0.0, sigma_max=20.0),
    lambda: schedules.Polynomial(power=0.0),
    lambda: schedules.Polynomial(power=-2.0),
    lambda: schedules.MD4Linear(eps=0.5),
    lambda: schedules.MD4Linear(eps=-1e-4),
    lambda: get_schedule("loglinear", eps=1.5),
    lambda: get_schedule("geometric", sigma_min=5.0, sigma_max=1.0),
  ],
)
def test_invalid_params_raise(make):
  with pytest.raises(ValueError):
    make()


# ---------------------------------------------------------------- dataclass / jit
@pytest.mark.parametrize("name", NAMES)
def test_frozen_and_hashable(name):
  s = get_schedule(name)
  assert dataclasses.is_dataclass(s)
  fields = [f.name for f in dataclasses.fields(s)]
  target = fields[0] if fields else "extra_attribute"
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(s, target, 0.5)
  # Equal instances are equal and hash equal (a jit cache hit).
  assert s == get_schedule(name)
  assert hash(s) == hash(get_schedule(name))
  assert len({s, get_schedule(name)}) == 1


@pytest.mark.parametrize("name", NAMES)
def test_static_arg_to_jit_and_jit_agrees(name):
  traces = []

  def f(schedule, t):
    traces.append(schedule)
    return schedule.alpha(t), schedule.dalpha(t), schedule.weight(t), schedule.mask_prob(t)

  jf = jax.jit(f, static_argnums=0)
  t = jnp.asarray(GRID, jnp.float32)
  s = get_schedule(name)
  out_jit = jf(s, t)
  eager = f(s, t)
  for a, b in zip(out_jit, eager):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
  n = len(traces)
  jf(get_schedule(name), t)  # an equal, distinct instance hits the cache: no retrace
  assert len(traces) == n
  assert n == 2  # one trace under jit + one eager call


def test_different_params_are_different_static_args():
  a, b = schedules.LogLinear(eps=1e-3), schedules.LogLinear(eps=1e-2)
  assert a != b
  jf = jax.jit(lambda s, t: s.alpha(t), static_argnums=0)
  assert float(jf(a, 1.0)) == pytest.approx(1e-3, abs=ATOL32_UNIT)
  assert float(jf(b, 1.0)) == pytest.approx(1e-2, abs=ATOL32_UNIT)
