"""The uniform-state process (md4jax.diffusion.uniform): its forward law, exact posterior, bounds.

Exact checks enumerate every noisy sequence z of a short chain (V = 3, L = 5: 243 states) and
integrate t by Gauss–Legendre; Monte Carlo checks allow 4 standard errors, estimated from the
same draws.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.diffusion import bounds, groundtruth, schedules, uniform

VOCAB, LENGTH = 3, 5
ORACLE_SCHEDULES = ("linear", "cosine", "loglinear")


@pytest.fixture(scope="module")
def small():
  """A short chain, one of its sequences x, and every z [V^L, L] with x tiled to match."""
  language = groundtruth.MarkovLanguage(VOCAB, seed=3)
  x = np.asarray(language.sample(jax.random.PRNGKey(4), 1, LENGTH))[0]
  every_z = np.array(list(itertools.product(range(VOCAB), repeat=LENGTH)), np.int32)
  return language, x, every_z, np.broadcast_to(x, every_z.shape)


def _forward_law(x_tiled, every_z, alpha):
  """q_t(z | x) of every z [V^L], float64."""
  spread = (1.0 - alpha) / VOCAB
  return np.where(every_z == x_tiled, alpha + spread, spread).prod(-1)


def _expected_over_z(x_tiled, every_z, alpha, values):
  """Σ_z q(z | x) values(z) at each α [N] (jax, for one jitted call over all nodes or steps)."""
  spread = (1.0 - alpha[:, None, None]) / VOCAB
  law = jnp.where(every_z == x_tiled, alpha[:, None, None] + spread, spread).prod(-1)
  return (law * values).sum(-1)


def _exact_continuous_bound(language, x, every_z, x_tiled, schedule, nodes=64):
  """∫ E_{z_t | x} [integrand] dt by enumeration of z and Gauss–Legendre in u, t = u², plus
  the prior term: no Monte Carlo."""
  denoise = language.uniform_denoise_fn()
  points, weights = np.polynomial.legendre.leggauss(nodes)
  u = (points + 1.0) / 2.0
  z, x_rows = jnp.asarray(every_z), jnp.asarray(x_tiled)

  @jax.jit
  def at_time(t):  # t: scalar → E_z[Σ integrand]
    t = jnp.full(len(every_z), t, jnp.float32)
    alpha = schedule.alpha(t)
    log_probs = jax.nn.log_softmax(denoise(z, alpha), -1)
    integrand = uniform.continuous_integrand(
      log_probs, x_rows, z, alpha, schedule.mask_prob(t), -schedule.dalpha(t) / alpha
    ).sum(-1)
    return _expected_over_z(x_rows, z, alpha[:1], integrand)[0]

  values = np.asarray(jax.lax.map(at_time, jnp.asarray(u * u, jnp.float32)), np.float64)
  total = float(np.sum(weights / 2.0 * 2.0 * u * values))
  if schedule.needs_prior_term:
    total += len(x) * uniform.prior_kl(schedule.alpha_at_1, VOCAB)
  return total


def _exact_discrete_bound(language, x, every_z, x_tiled, schedule, num_steps):
  """L_T: Σ_i E_{z_{t_i} | x} Σ_ℓ KL(q(z_s | z_t, x) ‖ p_θ(z_s | z_t)), z enumerated."""
  denoise = language.uniform_denoise_fn()
  z, x_rows = jnp.asarray(every_z), jnp.asarray(x_tiled)
  clean = jax.nn.one_hot(x_rows, VOCAB)

  @jax.jit
  def at_step(times):  # (t, s) → E_z[Σ KL]
    alpha_t = jnp.full(len(every_z), schedule.alpha(times[0]), jnp.float32)
    alpha_s = jnp.full(len(every_z), schedule.alpha(times[1]), jnp.float32)
    model = uniform.reverse_probs(jax.nn.softmax(denoise(z, alpha_t), -1), z, alpha_t, alpha_s)
    kl = uniform._kl_rows(uniform.reverse_probs(clean, z, alpha_t, alpha_s), model).sum(-1)
    return _expected_over_z(x_rows, z, alpha_t[:1], kl)[0]

  grid = np.arange(num_steps + 1, dtype=np.float32) / num_steps
  times = jnp.asarray(np.stack([grid[1:], grid[:-1]], -1))
  total = float(np.sum(np.asarray(jax.lax.map(at_step, times), np.float64)))
  if schedule.needs_prior_term:
    total += len(x) * uniform.prior_kl(schedule.alpha_at_1, VOCAB)
  return total


# ---------------------------------------------------------------- the forward process
def test_corrupt_keeps_alpha_and_spreads_the_rest_uniformly():
  x = jnp.zeros((4000, 16), jnp.int32)
  editable = jnp.arange(16)[None, :] < 12
  alpha = 0.3
  z = np.asarray(uniform.corrupt(jax.random.PRNGKey(0), x, alpha, vocab_size=4, editable=editable))
  assert np.all(z[:, 12:] == 0)  # Non-editable positions never change.
  counts = np.bincount(z[:, :12].ravel(), minlength=4) / z[:, :12].size
  expected = np.array([alpha + (1 - alpha) / 4] + [(1 - alpha) / 4] * 3)
  se = np.sqrt(expected * (1 - expected) / z[:, :12].size)
  np.testing.assert_array_less(np.abs(counts - expected), 4 * se)


def test_the_oracle_is_the_posterior_by_enumeration(small):
  language, x, every_z, _ = small
  alpha = 0.4
  clean_sequences = every_z  # every x', the same enumeration
  prior = np.exp(np.asarray(language.log_prob(jnp.asarray(clean_sequences)), np.float64))
  z = every_z[[7, 100, 242]]
  logits = language.uniform_denoise_fn()(jnp.asarray(z), jnp.full((3,), alpha))
  for row, z_row in enumerate(z):
    joint = prior * _forward_law(clean_sequences, np.broadcast_to(z_row, every_z.shape), alpha)
    posterior = joint / joint.sum()
    for position in range(LENGTH):
      marginal = np.bincount(clean_sequences[:, position], posterior, minlength=VOCAB)
      np.testing.assert_allclose(
        np.exp(np.asarray(logits[row, position], np.float64)), marginal, atol=1e-5
      )


def test_reverse_step_is_bayes_rule_and_ends_in_the_denoiser(small):
  """With μ = one_hot(x), reverse_probs is q(z_s | z_t, x) ∝ q(z_t | z_s) q(z_s | x); with
  α_s = 1 it is μ itself."""
  _, _, every_z, _ = small
  alpha_t, alpha_s, x_value = 0.3, 0.7, 2
  z = jnp.asarray(every_z[:20])
  got = uniform.reverse_probs(
    jax.nn.one_hot(jnp.full(z.shape, x_value), VOCAB),
    z,
    jnp.full(20, alpha_t),
    jnp.full(20, alpha_s),
  )
  step = alpha_t / alpha_s
  for v in range(VOCAB):
    given_s = np.where(np.asarray(z) == v, step + (1 - step) / VOCAB, (1 - step) / VOCAB)
    from_x = alpha_s * (v == x_value) + (1 - alpha_s) / VOCAB
    unnormalized = given_s * from_x
    normalizer = np.where(
      np.asarray(z) == x_value, alpha_t + (1 - alpha_t) / VOCAB, (1 - alpha_t) / VOCAB
    )
    np.testing.assert_allclose(np.asarray(got[..., v]), unnormalized / normalizer, rtol=1e-5)
  probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(1), (20, LENGTH, VOCAB)), -1)
  np.testing.assert_allclose(
    uniform.reverse_probs(probs, z, jnp.full(20, alpha_t), jnp.ones(20)), probs, rtol=1e-5
  )


# ---------------------------------------------------------------- the bounds, exactly
@pytest.mark.parametrize("schedule_name", ORACLE_SCHEDULES)
def test_continuous_bound_of_the_exact_posterior_is_the_exact_nll(small, schedule_name):
  language, x, every_z, x_tiled = small
  nll = -float(language.log_prob(jnp.asarray(x[None]))[0])
  bound = _exact_continuous_bound(
    language, x, every_z, x_tiled, schedules.get_schedule(schedule_name)
  )
  np.testing.assert_allclose(bound, nll, rtol=2e-5)


def test_a_wrong_denoiser_has_a_looser_continuous_bound(small):
  """The integrand is a Bregman divergence: any other denoiser's bound is above −log p(x)."""
  language, x, every_z, x_tiled = small
  nll = -float(language.log_prob(jnp.asarray(x[None]))[0])
  other = groundtruth.MarkovLanguage(VOCAB, seed=9)
  bound = _exact_continuous_bound(other, x, every_z, x_tiled, schedules.get_schedule("linear"))
  assert bound > nll + 0.1, (bound, nll)


@pytest.mark.parametrize("schedule_name", ["linear", "cosine"])
def test_discrete_bound_is_above_the_nll_and_tightens_with_steps(small, schedule_name):
  language, x, every_z, x_tiled = small
  nll = -float(language.log_prob(jnp.asarray(x[None]))[0])
  schedule = schedules.get_schedule(schedule_name)
  by_steps = {
    steps: _exact_discrete_bound(language, x, every_z, x_tiled, schedule, steps)
    for steps in (4, 16, 64)
  }
  assert by_steps[4] > by_steps[16] > by_steps[64] > nll, (by_steps, nll)


# ---------------------------------------------------------------- the public estimator
@pytest.mark.parametrize("schedule_name", ORACLE_SCHEDULES)
def test_nelbo_is_unbiased_for_the_nll_with_the_exact_posterior(schedule_name):
  """nelbo(process="uniform") over 8,000 sequences of a chain: mean − NLL within 4 SE."""
  language = groundtruth.MarkovLanguage(5, seed=0)
  x = language.sample(jax.random.PRNGKey(0), 8000, 12)
  nll = -np.asarray(language.log_prob(x), np.float64)
  schedule = schedules.get_schedule(schedule_name)
  estimate = jax.jit(
    lambda key: bounds.nelbo(
      key, language.uniform_denoise_fn(), x, schedule, process="uniform", t_sampling="uniform"
    )
  )(jax.random.PRNGKey(1))
  gap = np.asarray(estimate, np.float64) - nll
  assert np.all(np.isfinite(gap))
  assert abs(gap.mean()) < 4 * gap.std(ddof=1) / np.sqrt(gap.size), gap.mean()


@pytest.mark.parametrize("num_steps", [4, 16])
def test_discrete_nelbo_estimates_the_exact_discrete_bound(small, num_steps):
  language, x, every_z, x_tiled = small
  schedule = schedules.get_schedule("linear")
  exact = _exact_discrete_bound(language, x, every_z, x_tiled, schedule, num_steps)
  batch = jnp.asarray(np.tile(x, (20000, 1)))
  estimate = jax.jit(
    lambda key: bounds.nelbo(
      key,
      language.uniform_denoise_fn(),
      batch,
      schedule,
      process="uniform",
      num_steps=num_steps,
      t_sampling="uniform",
    )
  )(jax.random.PRNGKey(num_steps))
  estimate = np.asarray(estimate, np.float64)
  assert abs(estimate.mean() - exact) < 4 * estimate.std(ddof=1) / np.sqrt(estimate.size)


def test_prompt_positions_are_neither_noised_nor_scored():
  """With the first half given, the bound estimates −log p(second half | first half)."""
  language = groundtruth.MarkovLanguage(5, seed=0)
  x = language.sample(jax.random.PRNGKey(2), 8000, 10)
  editable = jnp.broadcast_to(jnp.arange(10) >= 5, x.shape)
  conditional = -np.asarray(language.log_prob(x) - language.log_prob(x[:, :5]), np.float64)
  seen = []
  oracle = language.uniform_denoise_fn(editable)

  def recording(z_t, alpha_t):
    seen.append(z_t)
    return oracle(z_t, alpha_t)

  estimate = bounds.nelbo(
    jax.random.PRNGKey(3), recording, x, "linear", process="uniform", editable=editable
  )
  assert all(np.array_equal(np.asarray(z)[:, :5], np.asarray(x)[:, :5]) for z in seen[1:])
  gap = np.asarray(estimate, np.float64) - conditional
  assert abs(gap.mean()) < 4 * gap.std(ddof=1) / np.sqrt(gap.size), gap.mean()


def _reference_integrand(probs, x, z, alpha, rate):
  """Σ_i Σ_{v≠z_i} (β/V) ρ_x (r − 1 − log r), float64 NumPy, straight from the formulas."""
  vocab_size = probs.shape[-1]
  spread = (1.0 - alpha) / vocab_size
  total = 0.0
  for i in range(len(x)):
    a = z[i]
    for v in range(vocab_size):
      if v == a:
        continue
      true = (alpha * (v == x[i]) + spread) / (alpha * (a == x[i]) + spread)
      model = sum(
        probs[i, y] * (alpha * (v == y) + spread) / (alpha * (a == y) + spread)
        for y in range(vocab_size)
      )
      ratio = model / true
      total += rate / vocab_size * true * (ratio - 1.0 - np.log(ratio))
  return total


@pytest.mark.parametrize("t", [1e-4, 0.01, 0.3, 0.9])
def test_the_integrand_is_its_formula(t):
  """Both branches of the float32 evaluation (small and large log ratios) against float64."""
  rng = np.random.default_rng(0)
  probs = rng.dirichlet(np.full(4, 0.5), size=6)
  x, z = rng.integers(0, 4, 6), rng.integers(0, 4, 6)
  z[:3] = x[:3]  # Clean positions and noised ones.
  alpha = 1.0 - t
  got = uniform.continuous_integrand(
    jnp.log(jnp.asarray(probs, jnp.float32))[None],
    jnp.asarray(x)[None],
    jnp.asarray(z)[None],
    jnp.array([alpha]),
    jnp.array([t]),
    jnp.array([1.0 / alpha]),
  ).sum()
  np.testing.assert_allclose(
    float(got), _reference_integrand(probs, x, z, alpha, 1.0 / alpha), rtol=1e-4
  )


@pytest.mark.parametrize("schedule_name", ["linear", "poly2", "poly3"])
def test_values_and_gradients_are_finite_down_to_the_smallest_time(schedule_name):
  """At a GPT-2-sized vocabulary, t down to the smallest t = u² a float32 u can draw: finite
  for a confident correct denoiser, one that copies its input, and one with mass on a wrong
  token (the bound is huge there, but a number)."""
  vocab_size = 50257
  x = jnp.array([[0, 1, 2, 1]])
  schedule = schedules.get_schedule(schedule_name)
  kinds = {
    "correct": lambda scale, z: scale * jax.nn.one_hot(x, vocab_size),
    "copies": lambda scale, z: scale * jax.nn.one_hot(z, vocab_size),
    "wrong_mass": lambda scale, z: (
      scale * jax.nn.one_hot(x, vocab_size) + 10.0 * jax.nn.one_hot(jnp.full_like(x, 7), vocab_size)
    ),
  }
  for kind, logits in kinds.items():

    def loss(scale, t, logits=logits):
      return uniform.continuous_loss_at(
        jax.random.PRNGKey(0),
        lambda z, alpha: logits(scale, z),
        x,
        schedule,
        jnp.array([t]),
        editable=jnp.ones_like(x, bool),
      ).sum()

    for t in (2.0**-48, 1e-9, 1e-7, 0.5, 1.0):
      value, grad = jax.value_and_grad(loss)(20.0, t)
      assert np.isfinite(value) and np.isfinite(grad), (kind, t, value, grad)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(process="absorbing"), "Unknown process"),
    (dict(process="uniform", estimator="forced_target"), "estimator='standard' only"),
    (dict(process="uniform", endpoint_terms="md4"), "endpoint_terms='sampled' only"),
    (dict(process="uniform", block_size=3), "block_size must divide"),
    (dict(process="uniform", time_input="t"), "time_input='alpha' only"),
  ],
)
def test_options_of_the_masked_process_are_refused_in_one_line(kwargs, message):
  language = groundtruth.MarkovLanguage(3, seed=0)
  x = jnp.zeros((2, 4), jnp.int32)
  with pytest.raises(ValueError, match=message):
    bounds.nelbo(jax.random.PRNGKey(0), language.uniform_denoise_fn(), x, "linear", **kwargs)


def test_a_state_dependent_schedule_is_refused():
  language = groundtruth.MarkovLanguage(3, seed=0)
  schedule = schedules.get_schedule("tokenpoly", exponents=np.array([1.0, 2.0, 3.0]))
  with pytest.raises(ValueError, match="mask-rate schedule"):
    bounds.nelbo(
      jax.random.PRNGKey(0),
      language.uniform_denoise_fn(),
      jnp.zeros((2, 4), jnp.int32),
      schedule,
      process="uniform",
    )
