"""GenMD4 (state-dependent schedules) against exact ground truth: the bound, its gradient, the sampler."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_sampling  # pylint: disable=g-bad-import-order
import test_train  # pylint: disable=g-bad-import-order  (tests/ is on sys.path under pytest)

from md4jax import config as config_lib
from md4jax.diffusion import bounds, genmd4, groundtruth, masking, schedules
from md4jax.sampling import categorical, decoder, samplers
from md4jax.training import objective

VOCAB = 6
MASK_ID = VOCAB
LENGTH = 8
EXPONENTS = jnp.array([0.5, 2.0, 1.0, 3.0, 0.7, 1.5])  # Fixed, far from uniform.


@pytest.fixture(scope="module")
def language():
  return groundtruth.MarkovLanguage(VOCAB, seed=0)


@pytest.fixture(scope="module")
def schedule():
  return schedules.get_schedule("tokenpoly", exponents=EXPONENTS)


def test_schedule_is_per_token_and_validates_its_exponents(schedule):
  t = jnp.array([0.25, 0.5])
  np.testing.assert_allclose(
    schedule.alpha(t), 1.0 - np.asarray(t)[:, None] ** np.asarray(EXPONENTS), rtol=1e-6
  )
  np.testing.assert_allclose(
    schedule.weight(jnp.float32(0.5)), np.asarray(EXPONENTS) / 0.5, rtol=1e-6
  )
  # α′ analytic against a finite difference of α.
  h = 1e-3
  numeric = (schedule.alpha(jnp.float32(0.6 + h)) - schedule.alpha(jnp.float32(0.6 - h))) / (2 * h)
  np.testing.assert_allclose(schedule.dalpha(jnp.float32(0.6)), numeric, rtol=2e-3)
  assert schedule.state_dependent and not schedules.get_schedule("poly2").state_dependent
  with pytest.raises(ValueError, match="every exponent > 0"):
    schedules.get_schedule("tokenpoly", exponents=jnp.array([1.0, 0.0]))
  with pytest.raises(ValueError, match=r"positive \[V\] array"):
    schedules.get_schedule("tokenpoly", exponents=jnp.float32(2.0))


def test_shared_exponent_is_polyK_to_float_precision(language):
  """One shared exponent K: the same masks, the same bound (continuous and discrete) as polyK."""
  x = language.sample(jax.random.PRNGKey(0), 256, LENGTH)
  shared = schedules.get_schedule("tokenpoly", exponents=jnp.full((VOCAB,), 2.0))
  poly = schedules.get_schedule("poly2")
  time_free = language.denoise_fn(MASK_ID)
  for num_steps in (None, 8):
    key = jax.random.PRNGKey(num_steps or 1)
    genmd4_nats = bounds.nelbo(
      key, time_free, x, shared, mask_id=MASK_ID, num_steps=num_steps, reconstruction_time=0.0
    )
    poly_nats = bounds.nelbo(key, time_free, x, poly, mask_id=MASK_ID, num_steps=num_steps)
    np.testing.assert_allclose(genmd4_nats, poly_nats, rtol=2e-5, atol=2e-5)
  t = jnp.full((256,), 0.4)
  z, _ = genmd4.corrupt(
    masking.row_keys(jax.random.PRNGKey(3), 256),
    x,
    shared,
    t,
    mask_id=MASK_ID,
    editable=jnp.ones(x.shape, bool),
  )
  z_poly = masking.corrupt(
    masking.row_keys(jax.random.PRNGKey(3), 256), x, poly.alpha(t), mask_id=MASK_ID
  )
  np.testing.assert_array_equal(z, z_poly)


def test_oracle_is_the_brute_force_posterior(language, schedule):
  """Forward–backward with token-dependent evidence equals enumeration over all sequences."""
  length = 4
  z = jnp.array([[MASK_ID, 2, MASK_ID, MASK_ID]])
  t = jnp.array([0.3])
  every = jnp.array(list(itertools.product(range(VOCAB), repeat=length)))
  hidden = schedule.mask_prob(t)[0]
  weight = jnp.exp(language.log_prob(every)) * jnp.where(
    z == MASK_ID, hidden[every], (every == z).astype(jnp.float32)
  ).prod(-1)
  posterior = jax.nn.softmax(language.denoise_fn(MASK_ID, schedule)(z, t)[0], axis=-1)
  for position in (0, 2, 3):
    brute = np.array([weight[every[:, position] == v].sum() for v in range(VOCAB)]) / weight.sum()
    np.testing.assert_allclose(posterior[position], brute, atol=1e-5)


def _nelbo_minus_exact(language, schedule, num_steps, num_draws, num_sequences=2000):
  x = language.sample(jax.random.PRNGKey(0), num_sequences, LENGTH)
  denoise_fn = language.denoise_fn(MASK_ID, schedule)
  draw = jax.jit(
    lambda key: bounds.nelbo(key, denoise_fn, x, schedule, mask_id=MASK_ID, num_steps=num_steps)
  )
  estimate = np.mean(
    [np.asarray(draw(jax.random.PRNGKey(i)), np.float64) for i in range(num_draws)], 0
  )
  gap = estimate + np.asarray(language.log_prob(x), np.float64)
  return gap.mean(), gap.std(ddof=1) / np.sqrt(gap.size)


def test_oracle_nelbo_is_the_exact_nll_and_discrete_bounds_lie_above(language, schedule):
  """Measured: continuous +0.034 ± 0.060 nats (exact NLL ≈ 12.3); T = 4: +0.79 ± 0.07, T = 16: +0.14 ± 0.08."""
  gap, se = _nelbo_minus_exact(language, schedule, None, num_draws=16)
  assert abs(gap) < 4 * se, (gap, se)
  gap_4, se_4 = _nelbo_minus_exact(language, schedule, 4, num_draws=4)
  gap_16, se_16 = _nelbo_minus_exact(language, schedule, 16, num_draws=4)
  assert gap_4 > 4 * se_4, (gap_4, se_4)  # Clearly above the NLL, and tightening with T.
  assert gap_16 > -3 * se_16 and gap_4 - gap_16 > 3 * np.hypot(se_4, se_16), (gap_16, se_16)


def test_state_dependent_bound_refuses_other_estimators(language, schedule):
  x = language.sample(jax.random.PRNGKey(0), 4, LENGTH)
  with pytest.raises(ValueError, match="has its own bound"):
    bounds.nelbo(
      jax.random.PRNGKey(0),
      language.denoise_fn(MASK_ID, schedule),
      x,
      schedule,
      mask_id=MASK_ID,
      estimator="mask_count",
    )


# ---- The gradient of the exponents against a finite difference of the exact bound ----
GRAD_VOCAB, GRAD_LENGTH, EPS = 3, 3, 0.05
GRAD_SEQUENCES = jnp.array([[0, 1, 2], [2, 2, 0], [1, 0, 1], [0, 0, 0]], jnp.int32)


def _exact_bound(oracle, exponents, num_nodes=96):
  """The mean bound of GRAD_SEQUENCES, exactly: every mask pattern enumerated, t by Gauss–Legendre."""
  schedule = schedules.get_schedule("tokenpoly", exponents=exponents)
  nodes, weights = np.polynomial.legendre.leggauss(num_nodes)
  s, weights = (nodes + 1) / 2, weights / 2
  t = EPS + (1 - EPS) * s**4  # t − ε ∝ s⁴ smooths the t^(w−1) singularity at small t.
  dt = (1 - EPS) * 4 * s**3 * weights
  patterns = np.array(list(itertools.product([False, True], repeat=GRAD_LENGTH)))

  def expected(times, per_sequence):
    """Σ over patterns of q(pattern | x, t) · per_sequence(z, t), [num sequences, num times]."""
    shape = (GRAD_SEQUENCES.shape[0], patterns.shape[0], times.size, GRAD_LENGTH)
    x = jnp.broadcast_to(GRAD_SEQUENCES[:, None, None, :], shape).reshape(-1, GRAD_LENGTH)
    masked = jnp.broadcast_to(patterns[None, :, None, :], shape).reshape(-1, GRAD_LENGTH)
    flat_times = jnp.broadcast_to(
      jnp.asarray(times, jnp.float32)[None, None, :], shape[:3]
    ).reshape(-1)
    z = jnp.where(masked, GRAD_VOCAB, x)
    mask_prob = genmd4.position_mask_prob(schedule, flat_times, x)
    q = jnp.where(masked, mask_prob, 1 - mask_prob).prod(-1)
    return (q * per_sequence(oracle(z, flat_times), x, z, flat_times)).reshape(shape[:3]).sum(1)

  main = expected(
    t,
    lambda logits, x, z, times: genmd4.continuous_integrand(
      logits, x, z, schedule, times, mask_id=GRAD_VOCAB
    ),
  )
  recon = expected(
    np.array([EPS]),
    lambda logits, x, z, times: masking.masked_cross_entropy(logits, x, z, mask_id=GRAD_VOCAB).sum(
      -1
    ),
  )
  return ((main * jnp.asarray(dt, jnp.float32)).sum() + recon.sum()) / GRAD_SEQUENCES.shape[0]


def _gradient_draws(oracle, exponents, gradient, num_draws=24, repeats=2000):
  """Surrogate gradients w.r.t. the exponents, one per draw (each averaged over `repeats` copies).

  Reverse mode only: on XLA:CPU (jax 0.10.2) a jitted forward-mode jacobian of this
  function at ~16k rows came out wrong while its values and reverse-mode grads were right.
  """
  x = jnp.tile(GRAD_SEQUENCES, (repeats, 1))

  def loss(w, key):
    schedule = schedules.get_schedule("tokenpoly", exponents=w)
    u = masking.sample_times(key, x.shape[0], "stratified")
    keys = masking.row_keys(jax.random.fold_in(key, 1), x.shape[0])
    nats, surrogate = genmd4.surrogate(
      keys,
      oracle,
      x,
      schedule,
      u,
      jnp.ones(x.shape, bool),
      mask_id=GRAD_VOCAB,
      gradient=gradient,
      reconstruction_time=EPS,
    )
    return surrogate.mean(), nats.mean()

  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  draws = [step(exponents, jax.random.PRNGKey(i)) for i in range(num_draws)]
  values = np.array([float(v) for (v, _), _ in draws])
  nats = np.array([float(n) for (_, n), _ in draws])
  np.testing.assert_allclose(values, nats, rtol=1e-6)  # The surrogate's value is the NELBO draw.
  return np.stack([np.asarray(g) for _, g in draws]), nats


@pytest.fixture(scope="module")
def gradient_setup():
  language = groundtruth.MarkovLanguage(GRAD_VOCAB, seed=1)
  # The denoiser is the exact posterior for other exponents, so the bound is not at its minimum.
  oracle = language.denoise_fn(
    GRAD_VOCAB, schedules.get_schedule("tokenpoly", exponents=jnp.array([0.6, 1.0, 2.0]))
  )
  exponents = jnp.array([1.2, 0.7, 1.5])
  h = 1e-2
  finite_difference = np.array(
    [
      (_exact_bound(oracle, exponents + h * e) - _exact_bound(oracle, exponents - h * e)) / (2 * h)
      for e in np.eye(GRAD_VOCAB)
    ]
  )
  return oracle, exponents, finite_difference


@pytest.mark.parametrize("gradient", ["rloo", "score"])
def test_exponent_gradient_matches_finite_difference_of_exact_bound(gradient_setup, gradient):
  """Measured (24 draws × 8000 rows): fd [0.029, 0.257, −0.174]; rloo within ~2 SE."""
  oracle, exponents, finite_difference = gradient_setup
  grads, nats = _gradient_draws(oracle, exponents, gradient)
  mean, se = grads.mean(0), grads.std(0, ddof=1) / np.sqrt(len(grads))
  assert np.all(np.abs(mean - finite_difference) < 4 * se + 1e-3), (mean, se, finite_difference)
  assert np.abs(finite_difference).max() > 10 * se.max()  # The test can tell a wrong gradient.
  exact = float(_exact_bound(oracle, exponents))
  assert abs(nats.mean() - exact) < 4 * nats.std(ddof=1) / np.sqrt(len(nats)), (nats.mean(), exact)


# ---- The sampler ----
def _samples(language, schedule, num_steps, batch_size=4000, **kwargs):
  run = jax.jit(
    lambda key: decoder.sample(
      key,
      language.denoise_fn(MASK_ID, schedule),
      batch_size=batch_size,
      length=LENGTH,
      schedule=schedule,
      mask_id=MASK_ID,
      num_steps=num_steps,
      **kwargs,
    )
  )
  tokens, info = run(jax.random.PRNGKey(5))
  return np.asarray(tokens), int(info["nfe"])


@pytest.mark.slow
def test_sampler_with_many_steps_draws_the_chain(language, schedule):
  """Measured: −log p(sample) − H = +0.047 ± 0.033 nats at T = 256; +2.66 ± 0.06 at T = 4."""
  tokens, nfe = _samples(language, schedule, 256)
  assert nfe == 256 and not np.any(tokens == MASK_ID)
  nll = -np.asarray(language.log_prob(tokens), np.float64)
  gap, se = nll.mean() - language.entropy(LENGTH), nll.std(ddof=1) / np.sqrt(nll.size)
  assert abs(gap) < 4 * se, (gap, se)
  test_sampling.assert_bigrams_follow_the_chain(language, tokens)
  few, _ = _samples(language, schedule, 4)
  few_nll = -np.asarray(language.log_prob(few), np.float64)
  assert few_nll.mean() - language.entropy(LENGTH) > 10 * few_nll.std(ddof=1) / np.sqrt(
    few_nll.size
  )


def test_sampler_loop_equals_a_python_loop_and_clamps_prompts(language, schedule):
  """The jitted fori_loop against the reverse step written out in Python, draw for draw."""
  prompt = jnp.full((LENGTH,), MASK_ID).at[0].set(3).at[5].set(1)
  key, num_steps, batch = jax.random.PRNGKey(2), 6, 64
  denoise_fn = language.denoise_fn(MASK_ID, schedule)
  tokens, info = jax.jit(
    lambda k: decoder.sample(
      k,
      denoise_fn,
      batch_size=batch,
      length=LENGTH,
      schedule=schedule,
      mask_id=MASK_ID,
      num_steps=num_steps,
      prompt=prompt,
      record_trajectory=True,
    )
  )(key)
  z = jnp.broadcast_to(prompt, (batch, LENGTH)).astype(jnp.int32)
  grid = samplers.time_grid(num_steps)
  for step in range(num_steps, 0, -1):
    time = jnp.full((batch,), grid[step])
    probs = jax.nn.softmax(denoise_fn(z, time).astype(jnp.float32), -1)
    stay = schedule.mask_prob(grid[step - 1]) / schedule.mask_prob(grid[step]) if step > 1 else 0.0
    outcome = jnp.concatenate([probs * (1 - stay), (probs * stay).sum(-1, keepdims=True)], -1)
    # Row b draws from its own key fold_in(key, b) alone.
    drawn = jnp.stack(
      [
        categorical.sample_categorical(
          jax.random.fold_in(jax.random.fold_in(key, b), step), jnp.log(outcome[b])
        )
        for b in range(batch)
      ]
    )
    z = jnp.where(z == MASK_ID, drawn, z)
  np.testing.assert_array_equal(tokens, z)
  assert np.all(np.asarray(tokens)[:, [0, 5]] == [3, 1])
  states = np.asarray(info["trajectory"]["tokens"])
  revealed = states[:-1] != MASK_ID
  assert np.all(states[1:][revealed] == states[:-1][revealed])  # Revealed tokens never change.


def test_sampler_refuses_methods_that_assume_one_mask_rate(language, schedule):
  for method in ("cached", "first_hitting", "confidence"):
    with pytest.raises(ValueError, match="samples with method='ancestral' only"):
      decoder.sample(
        jax.random.PRNGKey(0),
        language.denoise_fn(MASK_ID, schedule),
        batch_size=2,
        length=LENGTH,
        schedule=schedule,
        mask_id=MASK_ID,
        method=method,
        num_steps=4,
      )


# ---- Training with a learned schedule ----
def _learned_config(**diffusion):
  config = config_lib.load_config("tiny")
  config.diffusion.schedule = "learned_tokenpoly"
  config.model.time_conditioning = "adaln"
  config.training.estimator = config.eval.estimator = "standard"
  config.frontier.methods = "ancestral"
  config.mesh.data = 1
  for name, value in diffusion.items():
    config.diffusion[name] = value
  config.lock()
  return config


def _steps(config, num_steps=3):
  return test_train.first_steps(config, jax.devices()[:1], num_steps)


def test_learned_schedule_trains_its_exponents_and_reports_the_nelbo():
  config = _learned_config(exponent_init=1.5)
  state, history = _steps(config)
  w = np.asarray(objective.exponents(state.params, config))
  assert w.shape == (config.data.vocab_size,) and np.all(np.isfinite(w))
  assert np.abs(w - 1.5).max() > 1e-4 and np.std(w) > 0  # Moved, and per token.
  assert history[-1]["exponent_std"] == pytest.approx(float(np.std(w)), rel=1e-4)
  assert all(np.isfinite(m["loss"]) for m in history)
  frozen_config = _learned_config(exponent_init=1.5, exponent_learning_rate=0.0)
  frozen, frozen_history = _steps(frozen_config)
  np.testing.assert_allclose(objective.exponents(frozen.params, frozen_config), 1.5, rtol=1e-6)
  # The first step's reported loss is the NELBO draw, not the surrogate: it does not depend on θ's LR.
  assert frozen_history[0]["loss"] == pytest.approx(history[0]["loss"], rel=1e-6)


def test_learned_schedule_config_is_validated():
  config = _learned_config()
  config_lib.validate_config(config, 1)
  for key, value, message in [
    ("model.time_conditioning", "none", "needs a time-conditioned denoiser"),
    ("eval.estimator", "mask_count", "has its own bound"),
    ("sample.method", "first_hitting", "'ancestral' only"),
    ("diffusion.exponent_gradient", "pathwise", "exponent_gradient"),
    ("diffusion.exponent_init", 0.0, "exponent_init must be > 0"),
  ]:
    bad = config_lib.load_config("tiny")
    bad.update(config)
    section, name = key.split(".")
    bad[section][name] = value
    with pytest.raises(ValueError, match=message):
      config_lib.validate_config(bad, 1)
  saved = config_lib.load_config("tiny").to_dict()  # A linear-schedule checkpoint.
  assert config_lib.resume_changes(saved, config) == [
    "model.time_conditioning: 'none' → 'adaln'",
    "diffusion.schedule: 'linear' → 'learned_tokenpoly'",
  ]
