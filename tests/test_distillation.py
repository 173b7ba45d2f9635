"""SDTT's few-step students (md4jax.posttraining.distillation, --mode=distill).

The teacher's targets are checked against their exact expectation by enumeration on the
generated language: with the exact posterior as the teacher, a masked position's target is the
first step's posterior with the probability r1 that the first step reveals it, and otherwise the
second step's posterior averaged over every state the first step leads to. The mode's rounds,
resume and refusals are checked on a tiny trained model.
"""

import itertools
import json
import math
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import md4jax
from md4jax import config as config_lib
from md4jax.app import distill, modes
from md4jax.diffusion import duality, groundtruth, schedules
from md4jax.posttraining import distillation
from md4jax.runtime import workdir as workdir_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB = 3


def _exact_expected_target(language, z_t, t, dt, schedule):
  """E[exp(target)] and E[exp(target)²] [L, V] at z_t [L] by enumerating the first step's
  outcomes, and the masked positions."""
  oracle = language.denoise_fn(VOCAB)
  posterior = lambda z, time: np.asarray(
    jax.nn.softmax(oracle(jnp.asarray(z)[None], jnp.full((1,), schedule.alpha(time))), -1)[0],
    np.float64,
  )
  mask_t, mask_s = float(schedule.mask_prob(t)), float(schedule.mask_prob(t - dt))
  r1 = (mask_t - mask_s) / mask_t
  first = posterior(z_t, t)
  masked = [i for i, v in enumerate(z_t) if v == VOCAB]
  expected, squared = np.zeros((len(z_t), VOCAB)), np.zeros((len(z_t), VOCAB))
  # Each masked position stays masked (−1) or is revealed as v, independently.
  for outcome in itertools.product([-1, *range(VOCAB)], repeat=len(masked)):
    weight, z_s = 1.0, list(z_t)
    for position, value in zip(masked, outcome):
      weight *= (1 - r1) if value < 0 else r1 * first[position, value]
      if value >= 0:
        z_s[position] = value
    second = posterior(z_s, t - dt)
    for position, value in zip(masked, outcome):
      law = first[position] if value >= 0 else second[position]
      expected[position] += weight * law
      squared[position] += weight * law**2
  return expected, squared, masked


@pytest.mark.parametrize(
  "schedule_name", ["linear", pytest.param("cosine", marks=pytest.mark.slow)]
)
def test_the_teacher_targets_match_their_exact_law(schedule_name):
  """20,000 draws at one z_t: the mean and the mean square of every masked entry within 4 SE of
  the enumeration. The square tells the laws apart from one-hot targets of the drawn tokens
  (the same mean, the martingale of exact posteriors)."""
  language = groundtruth.MarkovLanguage(VOCAB, seed=3)
  schedule = schedules.get_schedule(schedule_name)
  z_t = np.array([VOCAB, 1, VOCAB, VOCAB, 0], np.int32)
  t, dt, n = 0.6, 0.2, 20000
  expected, squared, masked = _exact_expected_target(language, z_t, t, dt, schedule)
  targets = jax.jit(
    lambda key: distillation.teacher_targets(
      key,
      language.denoise_fn(VOCAB),
      jnp.tile(z_t, (n, 1)),
      jnp.full((n,), t),
      dt,
      schedule,
      mask_id=VOCAB,
    )
  )(jax.random.PRNGKey(0))
  draws = np.exp(np.asarray(targets, np.float64))[:, masked]
  for moment, exact in ((draws, expected[masked]), (draws**2, squared[masked])):
    mean, se = moment.mean(0), moment.std(0, ddof=1) / np.sqrt(n)
    assert np.all(np.abs(mean - exact) < 4 * se + 1e-6), (mean, exact, se)
  # One-hot targets would have E[target²] = E[target]: far from the laws' second moment.
  assert np.max(np.abs(expected[masked] - squared[masked])) > 0.1


def test_the_last_step_reveals_everything_so_targets_are_the_drawn_laws():
  """At t = 2dt the second step reaches t = 0 (linear: α = 1): every masked position is revealed
  by one of the two steps, and a row's targets are a function of its own key (batch invariance)."""
  language = groundtruth.MarkovLanguage(VOCAB, seed=3)
  schedule = schedules.get_schedule("linear")
  z_t = jnp.full((6, 5), VOCAB, jnp.int32)
  t = jnp.full((6,), 0.5)
  targets = distillation.teacher_targets(
    jax.random.PRNGKey(1), language.denoise_fn(VOCAB), z_t, t, 0.25, schedule, mask_id=VOCAB
  )
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.PRNGKey(1), jnp.arange(6))
  alone = distillation.teacher_targets(
    keys[2:3], language.denoise_fn(VOCAB), z_t[2:3], t[2:3], 0.25, schedule, mask_id=VOCAB
  )
  np.testing.assert_allclose(targets[2:3], alone, rtol=1e-6)
  np.testing.assert_allclose(np.exp(np.asarray(targets)).sum(-1), 1.0, rtol=1e-5)


def _alpha_teacher(z, alpha):
  """A stub teacher whose law encodes the α it is called with: logits [10 α, 0, 0]."""
  row = jnp.stack([10.0 * alpha, jnp.zeros_like(alpha), jnp.zeros_like(alpha)], -1)
  return jnp.broadcast_to(row[:, None, :], (*z.shape, VOCAB))


def test_each_target_is_the_law_at_the_time_of_its_step():
  """t = 0.6, dt = 0.2 (linear): a position revealed by the first step (prob 1/3) gets the law at
  α(t) = 0.4, every other the law at α(t − dt) = 0.6, and no third law appears."""
  n = 20000
  targets = distillation.teacher_targets(
    jax.random.PRNGKey(2),
    _alpha_teacher,
    jnp.full((n, 4), VOCAB, jnp.int32),
    jnp.full((n,), 0.6),
    0.2,
    schedules.get_schedule("linear"),
    mask_id=VOCAB,
  )
  first, second = (
    np.asarray(jax.nn.log_softmax(_alpha_teacher(jnp.zeros((1, 1), jnp.int32), jnp.full((1,), a))))[
      0, 0
    ]
    for a in (0.4, 0.6)
  )
  targets = np.asarray(targets).reshape(-1, VOCAB)
  is_first = np.all(np.abs(targets - first) < 1e-5, -1)
  is_second = np.all(np.abs(targets - second) < 1e-5, -1)
  assert np.all(is_first | is_second)
  share, se = (
    is_first.mean(),
    math.sqrt(2 / 9 / targets.shape[0]) * 2,
  )  # Rows share no draws; 4 positions.
  assert abs(share - 1 / 3) < 4 * se, share


def test_dcd_reads_the_teacher_at_the_earlier_time_of_the_trajectory():
  """dcd_draw: t in (dt, 1]; the target is the teacher's law at s = t − dt (the stub encodes α),
  and z_s, the same noise at a higher signal, holds x wherever z_t does and more often."""
  config = config_lib.load_config("tiny")
  config.diffusion.process = "uniform"
  schedule = schedules.get_schedule("linear")
  tokens = jnp.zeros((4000, 8), jnp.int32)
  editable = jnp.ones_like(tokens, bool)
  t, z_t, log_target, scored = distillation.dcd_draw(
    jax.random.PRNGKey(0), _alpha_teacher, tokens, editable, schedule, 0.25, config
  )
  t = np.asarray(t)
  assert t.min() > 0.25 and t.max() <= 1.0 and np.asarray(scored).all()
  expected = jax.nn.log_softmax(_alpha_teacher(tokens, schedule.alpha(jnp.asarray(t) - 0.25)))
  np.testing.assert_allclose(log_target, expected, atol=1e-5)
  kept = np.asarray(z_t == 0).mean(-1)  # Share of x at t: about α(t) + (1 − α(t)) / V.
  np.testing.assert_allclose(kept.mean(), np.mean((1 - t) + t / config.data.vocab_size), atol=0.01)


def test_the_divergences_are_their_formulas():
  rng = np.random.default_rng(0)
  student = rng.normal(size=(2, 3, 5))
  target = rng.normal(size=(2, 3, 5))
  log_q = student - np.log(np.exp(student).sum(-1, keepdims=True))
  log_p = target - np.log(np.exp(target).sum(-1, keepdims=True))
  masked = np.array([[True, False, True], [False, True, True]])
  reverse = (np.exp(log_q) * (log_q - log_p)).sum(-1)
  forward = (np.exp(log_p) * (log_p - log_q)).sum(-1)
  for kind, reference in (("reverse_kl", reverse), ("forward_kl", forward)):
    got = distillation.divergence(jnp.asarray(student), jnp.asarray(log_p), masked, kind)
    np.testing.assert_allclose(got, np.where(masked, reference, 0).sum(-1), rtol=1e-5)
  same = distillation.divergence(jnp.asarray(student), jnp.asarray(log_q), masked)
  np.testing.assert_allclose(same, 0.0, atol=1e-6)


# ---------------------------------------------------------------- --mode=distill
@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """A tiny model trained 200 steps on the generated language."""
  root = tmp_path_factory.mktemp("distill")
  config = config_lib.load_config("tiny")
  config.num_train_steps = config.eval_every_steps = config.checkpoint_every_steps = 200
  config.log_every_steps = 200
  config.eval.discrete_steps, config.eval.profile_bins = "", 0
  config.sample.num_samples = 0
  modes.train_and_evaluate(config, root / "base")
  return root / "base"


def _config(base, **overrides):
  config = config_lib.load_config("tiny")
  config.num_train_steps = 4
  config.log_every_steps = 1
  config.checkpoint_every_steps = 1
  config.optimizer.warmup_steps = 1
  config.sample.num_samples = 0
  config.distill.init_from = str(base)
  config.distill.teacher_steps = 8
  config.distill.rounds = 2
  for name, value in overrides.items():
    section, _, key = name.rpartition("__")
    (config[section] if section else config)[key] = value
  return config


def _resumed_from(tmp_path, config, last: int):
  """The run of tmp_path / "whole" again from its checkpoint of step `last`: (whole, resumed)."""
  resumed = workdir_lib.as_workdir(tmp_path / f"resumed_{last}")
  shutil.copytree(tmp_path / "whole", resumed.root)
  for step in resumed.checkpoints.iterdir():
    if step.name.isdigit() and int(step.name) > last:
      shutil.rmtree(step)
  distill.distill(config, resumed.root)
  whole, again = md4jax.load(tmp_path / "whole"), md4jax.load(resumed.root)
  jax.tree.map(np.testing.assert_array_equal, whole.params, again.params)
  assert (tmp_path / "whole" / "metrics.jsonl").read_text() == resumed.metrics_jsonl.read_text()
  return resumed


def test_rounds_halve_the_steps_and_keep_their_teachers_for_a_resume(base, tmp_path):
  """4 steps in 2 rounds (students of 4, then 2 steps), one checkpoint kept besides the round
  ends: the round end survives, and a resume from it (round 2's teacher read back) ends with
  the same params and records; a resume with other rounds is refused."""
  config = _config(base)
  config.training.max_checkpoints_to_keep = 1
  distill.distill(config, tmp_path / "whole")
  records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").open()]
  assert [r["student_steps"] for r in records if "student_steps" in r] == [4, 4, 2, 2]
  kept = workdir_lib.as_workdir(tmp_path / "whole").checkpoints.iterdir()
  assert sorted(int(p.name) for p in kept if p.name.isdigit()) == [2, 4]
  resumed = _resumed_from(tmp_path, config, 2)
  with pytest.raises(ValueError, match="distill.rounds=2 \\(now 3\\)"):
    distill.distill(_config(base, num_train_steps=6, distill__rounds=3), resumed.root)


@pytest.mark.slow
def test_a_resume_inside_either_round_continues_exactly(base, tmp_path):
  """From step 1 (round 1: init_from's network read again) and step 3 (round 2: step 2's)."""
  config = _config(base)
  config.training.max_checkpoints_to_keep = 10
  distill.distill(config, tmp_path / "whole")
  for last in (1, 3):
    _resumed_from(tmp_path, config, last)


@pytest.mark.slow
def test_the_oracle_teacher_trains_the_student_toward_its_targets(base, tmp_path):
  """With the exact denoiser as the teacher, 40 steps of one round lower the loss."""
  config = _config(
    base,
    num_train_steps=40,
    distill__rounds=1,
    distill__teacher="oracle",
    checkpoint_every_steps=40,
  )
  config.optimizer.learning_rate = 3e-3
  distill.distill(config, tmp_path / "oracle")
  losses = [json.loads(line)["loss"] for line in (tmp_path / "oracle" / "metrics.jsonl").open()]
  assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:5]), losses


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"distill__teacher_steps": 6}, "divisible by 2\\^distill.rounds"),
    ({"num_train_steps": 5}, "divisible by distill.rounds"),
    ({"distill__init_from": ""}, "distill.init_from is empty"),
    ({"distill__teacher": "exact"}, "distill.teacher"),
    ({"model__self_condition": True}, "self_condition"),
  ],
)
def test_bad_settings_are_one_line(base, tmp_path, overrides, message):
  config = _config(base, **overrides)
  with pytest.raises(ValueError, match=message) as error:
    distill.distill(config, tmp_path / "bad")
  assert "\n" not in str(error.value)


@pytest.mark.slow
def test_the_distill_config_runs_from_the_default_workdir(tmp_path):
  """configs/distill.py from a configs/default.py workdir, on the command line (shortened)."""

  def run(*flags):
    result = subprocess.run(
      [sys.executable, "-m", "md4jax.main", *flags],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]

  short = [
    "--config.eval.num_sequences=64",
    "--config.eval.discrete_steps=",
    "--config.sample.num_samples=2",
  ]
  run(
    "--config=configs/default.py",
    f"--workdir={tmp_path / 'default'}",
    "--config.num_train_steps=20",
    "--config.optimizer.warmup_steps=5",
    "--config.eval_every_steps=20",
    "--config.eval.profile_bins=0",
    *short,
  )
  run(
    "--config=configs/distill.py",
    "--mode=distill",
    f"--workdir={tmp_path / 'student'}",
    f"--config.distill.init_from={tmp_path / 'default'}",
    "--config.num_train_steps=8",
    "--config.optimizer.warmup_steps=2",
    "--config.checkpoint_every_steps=2",
    "--config.sample.num_samples=2",
  )
  records = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").open()]
  assert [r["student_steps"] for r in records if "student_steps" in r] == [32, 16, 8, 4]
  samples = [json.loads(line) for line in (tmp_path / "student" / "samples.jsonl").open()]
  assert len(samples) == 2 and samples[0]["num_steps"] == 4


# ---------------------------------------------------------------- DCD (uniform-state)
def test_two_tokens_keep_x_with_the_normal_cdf():
  """V = 2: argmax(ν e_x + ε) = x iff ν > ε' − ε ~ N(0, 2), so I(ν) = Φ(ν / √2)."""
  nu = np.array([0.0, 0.5, 1.0, 3.0])
  expected = 0.5 * (1.0 + np.vectorize(math.erf)(nu / 2.0))
  np.testing.assert_allclose(duality.argmax_probability(nu, 2), expected, rtol=1e-7)


@pytest.mark.parametrize("vocab_size", [5, 32])
def test_coupled_states_are_exact_draws_of_the_process_on_one_trajectory(vocab_size):
  """Each of z_t, z_s: x with prob α + (1 − α)/V and every other token equally likely (χ²,
  p = 1e-4); and z_t = x implies z_s = x (a higher signal on x keeps it the argmax)."""
  n, dual = 40000, duality.Duality.of(vocab_size)
  x = jnp.full((n, 1), 1, jnp.int32)
  alpha_t, alpha_s = 0.3, 0.7
  z_t, z_s = duality.coupled_states(
    jax.random.PRNGKey(0),
    x,
    jnp.full((n,), dual.nu(alpha_t)),
    jnp.full((n,), dual.nu(alpha_s)),
    vocab_size,
  )
  for z, alpha in ((z_t, alpha_t), (z_s, alpha_s)):
    law = np.full(vocab_size, (1 - alpha) / vocab_size)
    law[1] += alpha
    counts = np.bincount(np.asarray(z).ravel(), minlength=vocab_size)
    assert stats.chisquare(counts, n * law).pvalue > 1e-4
  kept = np.asarray(z_t == 1)
  assert kept.any() and np.all(np.asarray(z_s)[kept] == 1)


def test_the_duality_inverts_its_map():
  dual = duality.Duality.of(50257)
  alpha = jnp.array([0.0, 1e-3, 0.1, 0.5, 0.9, 0.999, 1.0])
  np.testing.assert_allclose(dual.alpha(dual.nu(alpha)), alpha, atol=2e-6)
  assert np.all(np.diff(np.asarray(dual.nu(alpha))) > 0)


@pytest.fixture(scope="module")
def uniform_base(tmp_path_factory):
  """A tiny uniform-state model trained 100 steps on the generated language."""
  root = tmp_path_factory.mktemp("distill_uniform")
  config = _uniform_tiny()
  config.num_train_steps = config.eval_every_steps = config.checkpoint_every_steps = 100
  config.log_every_steps = 100
  config.eval.discrete_steps, config.eval.profile_bins = "", 0
  config.sample.num_samples = 0
  modes.train_and_evaluate(config, root / "base")
  return root / "base"


def _uniform_tiny():
  config = config_lib.load_config("tiny")
  config.diffusion.process = "uniform"
  config.model.time_conditioning = "adaln"
  config.training.estimator = config.eval.estimator = "standard"
  config.frontier.methods = "ancestral"
  return config


@pytest.mark.parametrize("teacher", ["", "oracle"])
def test_consistency_distillation_of_a_uniform_model_runs_its_rounds(
  uniform_base, tmp_path, teacher
):
  config = _uniform_tiny()
  config.num_train_steps, config.log_every_steps, config.checkpoint_every_steps = 4, 1, 2
  config.optimizer.warmup_steps = 1
  config.sample.num_samples, config.sample.num_steps = 2, 2
  config.distill.init_from, config.distill.teacher = str(uniform_base), teacher
  config.distill.teacher_steps, config.distill.rounds = 8, 2
  distill.distill(config, tmp_path / "student")
  records = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").open()]
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 4 and all(np.isfinite(losses)) and min(losses) > 0
  assert [r["scored_fraction"] for r in records if "loss" in r] == [1.0] * 4  # Every token.
  samples = [json.loads(line) for line in (tmp_path / "student" / "samples.jsonl").open()]
  assert len(samples) == 2


def test_a_metric_that_is_not_finite_stops_the_run_naming_the_kept_checkpoint():
  with pytest.raises(
    FloatingPointError, match="distill: a metric is not finite at step 3.*step 2's"
  ):
    modes.host_metrics({"loss": jnp.float32(np.nan)}, "distill", 3, 2)
  assert modes.host_metrics({"loss": jnp.float32(0.5)}, "distill", 3, 2) == {"loss": 0.5}


def test_an_init_from_of_another_process_is_one_line(base, tmp_path):
  config = _uniform_tiny()
  config.distill.init_from = str(base)  # A masked model.
  with pytest.raises(ValueError, match="trained with diffusion.process='masked'") as error:
    distill.distill(config, tmp_path / "bad")
  assert "\n" not in str(error.value)
