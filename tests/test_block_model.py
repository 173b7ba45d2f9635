"""Block diffusion's training path (BD3-LM): the network's one pass over z_t ⊕ x equals the reference
path (one call per block) in values and gradients, for XLA's attention and the splash kernel's
pattern; and the one-pass bound is unbiased for the exact NLL with the oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax import config as config_lib
from md4jax.diffusion import blocks, bounds, groundtruth, schedules
from md4jax.model.attention import block_pattern, softmax_attention
from md4jax.model.splash import splash_attention
from md4jax.model.transformer import Transformer
from md4jax.training import objective
from md4jax.training import state as state_lib

VOCAB, LENGTH, BLOCK = 7, 12, 4
MASK_ID = VOCAB


def test_block_pattern_one_and_two_streams():
  one = block_pattern(4, 2, two_stream=False)
  np.testing.assert_array_equal(one, [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
  two = block_pattern(8, 2, two_stream=True).astype(int)
  noisy_to_noisy, noisy_to_clean = two[:4, :4], two[:4, 4:]
  clean_to_noisy, clean_to_clean = two[4:, :4], two[4:, 4:]
  np.testing.assert_array_equal(noisy_to_noisy, [[1, 1, 0, 0]] * 2 + [[0, 0, 1, 1]] * 2)
  np.testing.assert_array_equal(noisy_to_clean, [[0, 0, 0, 0]] * 2 + [[1, 1, 0, 0]] * 2)
  np.testing.assert_array_equal(clean_to_noisy, np.zeros((4, 4)))
  np.testing.assert_array_equal(clean_to_clean, one)


def _model(**kwargs):
  return Transformer(
    vocab_size=VOCAB,
    num_layers=2,
    model_dim=32,
    num_heads=2,
    mlp_dim=64,
    block_size=BLOCK,
    weight_init="fan_in",
    **kwargs,
  )


@pytest.fixture(scope="module")
def setup():
  x = jax.random.randint(jax.random.PRNGKey(0), (3, LENGTH), 0, VOCAB)
  model = _model()
  params = model.init(jax.random.PRNGKey(1), x)["params"]
  # Random logits layer: the zero-free init still gives every position distinct logits.
  return model, params, x


def test_a_block_never_reads_later_blocks(setup):
  model, params, x = setup
  later = x.at[:, 2 * BLOCK :].set(MASK_ID)
  first_two = lambda tokens: np.asarray(model.apply({"params": params}, tokens))[:, : 2 * BLOCK]
  np.testing.assert_array_equal(first_two(x), first_two(later))
  assert not np.allclose(model.apply({"params": params}, later), model.apply({"params": params}, x))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("schedule_name", ["linear", "md4linear"])
def test_one_pass_equals_the_reference_path_in_value_and_gradient(setup, packed, schedule_name):
  model, params, x = setup
  schedule = schedules.get_schedule(schedule_name)
  segments = positions = None
  if packed:  # Two documents in the first row, padding at the end of the last.
    segments = jnp.asarray([[1] * 5 + [2] * 7, [1] * LENGTH, [1] * 9 + [0] * 3], jnp.int32)
    positions = jnp.asarray([list(range(5)) + list(range(7)), list(range(12)), list(range(12))])
  editable = jnp.ones(x.shape, bool) if segments is None else segments != 0
  draws = blocks.draws(jax.random.PRNGKey(3), x, schedule, BLOCK, editable=editable)
  assert 0 < draws["masked"].mean() < 1
  endpoint_terms = "md4" if schedule_name == "md4linear" else "sampled"

  def one_pass(params):
    pair_fn = lambda z, clean: model.apply({"params": params}, z, None, segments, positions, clean)
    return blocks.one_pass_nelbo(
      None,
      pair_fn,
      x,
      schedule,
      BLOCK,
      mask_id=MASK_ID,
      editable=editable,
      endpoint_terms=endpoint_terms,
      block_draws=draws,
    )

  def reference(params):
    denoise_fn = lambda z, time: model.apply({"params": params}, z, None, segments, positions)
    return bounds.nelbo(
      jax.random.PRNGKey(4),
      denoise_fn,
      x,
      schedule,
      mask_id=MASK_ID,
      editable=editable,
      endpoint_terms=endpoint_terms,
      draws=draws,
      block_size=BLOCK,
    )

  np.testing.assert_allclose(one_pass(params), reference(params), rtol=2e-6)
  grads = [jax.grad(lambda p, f=f: f(p).sum())(params) for f in (one_pass, reference)]
  flat = [jnp.concatenate([g.ravel() for g in jax.tree.leaves(tree)]) for tree in grads]
  assert float(jnp.abs(flat[1]).max()) > 1e-3
  np.testing.assert_allclose(flat[0], flat[1], rtol=0, atol=2e-5 * float(jnp.abs(flat[1]).max()))


def test_splash_kernel_with_the_two_stream_pattern_matches_xla():
  # The TPU kernel through its interpreter: the training pass's [2L, 2L] pattern at L = 128.
  length, block = 128, 32
  q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 2 * length, 2, 64), jnp.float32)
  pattern = block_pattern(2 * length, block, two_stream=True)
  expected = softmax_attention(q, k, v, jnp.asarray(pattern)[None, None])
  out = splash_attention(q, k, v, None, False, interpret=True, pattern=pattern)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=2e-5, atol=2e-5)


def test_the_model_refuses_what_block_diffusion_cannot_do(setup):
  _, params, x = setup
  with pytest.raises(ValueError, match=r"alpha \[B, L\]"):
    _model(time_conditioning="adaln").init(jax.random.PRNGKey(0), x, jnp.ones(3), clean=x)
  with pytest.raises(ValueError, match="block_size > 0"):
    Transformer(VOCAB, 1, 32, 2, 64).init(jax.random.PRNGKey(0), x, clean=x)
  with pytest.raises(ValueError, match="length it divides"):
    _model().apply({"params": params}, x[:, :10])


def _oracle_pair_fn(language, block_size):
  """The exact block posterior for every block in one call: block k of the answer is the oracle on
  (x's blocks < k, z's block k, later blocks masked)."""
  denoise_fn = language.denoise_fn(MASK_ID)

  def pair_fn(z, x):
    block_of = jnp.arange(x.shape[1]) // block_size
    out = 0.0
    for block in range(x.shape[1] // block_size):
      shown = jnp.where(block_of < block, x, jnp.where(block_of == block, z, MASK_ID))
      out = jnp.where((block_of == block)[None, :, None], denoise_fn(shown, None), out)
    return out

  return pair_fn


@pytest.mark.parametrize("block_size", [1, 4])
def test_one_pass_bound_is_unbiased_for_the_exact_nll(block_size):
  language = groundtruth.MarkovLanguage(VOCAB, seed=3)
  data = language.sample(jax.random.PRNGKey(0), 4000, 8)
  pair_fn = _oracle_pair_fn(language, block_size)
  run = jax.jit(
    functools.partial(
      blocks.one_pass_nelbo,
      pair_fn=pair_fn,
      x=data,
      schedule=schedules.get_schedule("cosine"),
      block_size=block_size,
      mask_id=MASK_ID,
    )
  )
  excess = np.asarray(run(jax.random.PRNGKey(1)), np.float64) + np.asarray(
    language.log_prob(data), np.float64
  )
  assert abs(excess.mean()) < 4 * excess.std(ddof=1) / np.sqrt(excess.size) + 1e-4, excess.mean()
  assert excess.std() > 0.01  # A real estimate, not the NLL handed back.


def _tiny_block_config(block_size):
  config = config_lib.load_config("tiny")
  config.diffusion.block_size, config.training.estimator = block_size, "standard"
  config_lib.validate_config(config, num_devices=1)
  return config


def test_the_objective_trains_blocks_in_one_pass_and_evaluates_on_the_reference_path():
  config = _tiny_block_config(4)
  model = state_lib.build_model(config)
  assert model.block_size == 4
  tokens = jax.random.randint(jax.random.PRNGKey(0), (4, config.data.seq_len), 0, 8)
  params = model.init(jax.random.PRNGKey(1), tokens)["params"]
  batch = {"tokens": tokens, "segment_ids": None, "positions": None, "editable": tokens >= 0}
  schedule = schedules.get_schedule(config.diffusion.schedule)
  draws = blocks.draws(jax.random.PRNGKey(2), tokens, schedule, 4)
  score = functools.partial(
    objective.sequence_nats, params, batch, model=model, config=config, t_sampling="stratified"
  )
  one_pass = score(jax.random.PRNGKey(3), estimator="standard", draws=draws)
  reference = bounds.nelbo(
    jax.random.PRNGKey(3),
    lambda z, time: model.apply({"params": params}, z, time),
    tokens,
    schedule,
    mask_id=config.data.vocab_size,
    draws=draws,
    block_size=4,
  )
  np.testing.assert_allclose(one_pass, reference, rtol=2e-6)
  # Evaluation's mask_count estimator runs the reference path: one call per block.
  evaluated = score(jax.random.PRNGKey(4), estimator="mask_count")
  assert evaluated.shape == (4,) and np.all(np.isfinite(evaluated)) and np.all(evaluated > 0)


def test_a_block_of_the_whole_sequence_is_todays_mdm_bit_for_bit():
  whole, plain = _tiny_block_config(16), _tiny_block_config(0)
  assert state_lib.build_model(whole).block_size == 0
  tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 16), 0, 8)
  batch = {"tokens": tokens, "segment_ids": None, "positions": None, "editable": tokens >= 0}
  model = state_lib.build_model(plain)
  params = model.init(jax.random.PRNGKey(1), tokens)["params"]
  nats = [
    objective.sequence_nats(
      params,
      batch,
      jax.random.PRNGKey(2),
      model=state_lib.build_model(config),
      config=config,
      estimator="standard",
      t_sampling="stratified",
    )
    for config in (whole, plain)
  ]
  np.testing.assert_array_equal(nats[0], nats[1])
