"""Block diffusion under uniform noise: the reference bound (one call per block) and the training
path (one two-stream pass) are unbiased for the exact NLL with the oracle, and the network's two
streams with per-position time equal a call per block."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import md4jax
from md4jax import config as config_lib
from md4jax.diffusion import bounds, groundtruth, schedules, uniform
from md4jax.diffusion.denoiser import Denoiser
from md4jax.model.transformer import Transformer
from md4jax.training import objective
from md4jax.training import state as state_lib

VOCAB, LENGTH, BLOCK = 5, 8, 4


def _within_4_se(gap):
  gap = np.asarray(gap, np.float64)
  assert np.all(np.isfinite(gap))
  assert abs(gap.mean()) < 4 * gap.std(ddof=1) / np.sqrt(gap.size), gap.mean()
  assert gap.std() > 0.01  # A real estimate, not the NLL handed back.


@pytest.fixture(scope="module")
def language():
  chain = groundtruth.MarkovLanguage(VOCAB, seed=0)
  return chain, chain.sample(jax.random.PRNGKey(0), 8000, LENGTH)


@pytest.mark.parametrize(
  "schedule_name, block_size", [("linear", 4), ("cosine", 2), ("md4linear", 4)]
)
def test_the_block_bound_of_the_exact_posterior_is_unbiased_for_the_nll(
  language, schedule_name, block_size
):
  chain, x = language
  estimate = jax.jit(
    lambda key: bounds.nelbo(
      key,
      chain.uniform_denoise_fn(),
      x,
      schedule_name,
      process="uniform",
      block_size=block_size,
      t_sampling="uniform",
    )
  )(jax.random.PRNGKey(1))
  _within_4_se(np.asarray(estimate, np.float64) + np.asarray(chain.log_prob(x), np.float64))


def test_the_discrete_block_bound_is_above_the_nll_and_tightens(language):
  chain, x = language
  nll = -np.asarray(chain.log_prob(x), np.float64)
  gaps = {}
  for num_steps in (1, 4):
    estimate = bounds.nelbo(
      jax.random.PRNGKey(num_steps),
      chain.uniform_denoise_fn(),
      x,
      "linear",
      process="uniform",
      block_size=BLOCK,
      num_steps=num_steps,
    )
    gap = np.asarray(estimate, np.float64) - nll  # Paired: the same sequences.
    gaps[num_steps] = gap.mean()
    assert gap.mean() > 4 * gap.std(ddof=1) / np.sqrt(gap.size), (num_steps, gap.mean())
  assert gaps[1] > gaps[4], gaps


def test_a_block_denoiser_reads_the_clean_prefix_the_noisy_block_and_noise_after(language):
  chain, x = language
  x = x[:4]
  seen = []

  def recording(z, keep):
    seen.append((z, keep))
    return chain.uniform_denoise_fn()(z, keep)

  with jax.disable_jit():  # Concrete calls, one block after the other.
    bounds.nelbo(jax.random.PRNGKey(2), recording, x, "linear", process="uniform", block_size=BLOCK)
  concrete = [(z, k) for z, k in seen if not isinstance(k, jax.core.Tracer) and k.ndim == 2]
  calls = [(np.asarray(z), np.asarray(keep)) for z, keep in concrete]
  first = [(z, keep) for z, keep in calls if np.all(keep[:, BLOCK:] == 0)]
  second = [(z, keep) for z, keep in calls if np.all(keep[:, :BLOCK] == 1)]
  assert first and second and len(first) + len(second) == len(calls)
  for z, keep in first:  # Block 0 noisy; later positions uniform draws, not x.
    assert np.all((keep[:, :BLOCK] > 0) & (keep[:, :BLOCK] < 1))
    assert not np.array_equal(z[:, BLOCK:], np.asarray(x)[:, BLOCK:])
  for z, keep in second:  # Block 0 clean, block 1 noisy.
    np.testing.assert_array_equal(z[:, :BLOCK], np.asarray(x)[:, :BLOCK])
    assert np.all((keep[:, BLOCK:] > 0) & (keep[:, BLOCK:] < 1))


def _oracle_pair_fn(chain, block_size):
  """The exact posterior of every block in one call: block k on (x's blocks < k, z's block k at
  its keep probability, later positions as uniform draws)."""
  denoise_fn = chain.uniform_denoise_fn()

  def pair_fn(z, x, keep):
    block_of = jnp.arange(x.shape[1]) // block_size
    out = 0.0
    for block in range(x.shape[1] // block_size):
      shown = jnp.where(block_of < block, x, z)
      known = jnp.where(block_of < block, 1.0, jnp.where(block_of == block, keep, 0.0))
      out = jnp.where((block_of == block)[None, :, None], denoise_fn(shown, known), out)
    return out

  return pair_fn


@pytest.mark.parametrize("schedule_name", ["linear", "md4linear"])
def test_the_one_pass_bound_is_unbiased_for_the_nll(language, schedule_name):
  chain, x = language
  run = jax.jit(
    functools.partial(
      uniform.one_pass_block_nelbo,
      pair_fn=_oracle_pair_fn(chain, BLOCK),
      x=x,
      schedule=schedules.get_schedule(schedule_name),
      block_size=BLOCK,
    )
  )
  _within_4_se(np.asarray(run(jax.random.PRNGKey(3)), np.float64) + np.asarray(chain.log_prob(x)))


def test_given_positions_are_neither_noised_nor_scored_in_one_pass(language):
  chain, x = language
  editable = jnp.broadcast_to(jnp.arange(LENGTH) >= 3, x.shape)
  conditional = chain.log_prob(x) - chain.log_prob(x[:, :3])
  pair_fn = _oracle_pair_fn(chain, BLOCK)
  estimate = uniform.one_pass_block_nelbo(
    jax.random.PRNGKey(4), pair_fn, x, schedules.get_schedule("linear"), BLOCK, editable=editable
  )
  _within_4_se(np.asarray(estimate, np.float64) + np.asarray(conditional, np.float64))


# ---------------------------------------------------------------- the network
def _network(block_size=BLOCK):
  return Transformer(
    vocab_size=VOCAB,
    num_layers=2,
    model_dim=32,
    num_heads=2,
    mlp_dim=64,
    block_size=block_size,
    time_conditioning="adaln",
    weight_init="fan_in",
  )


def _random_params(model, x, keep):
  """Params with every adaLN projection random (zero at init: time would change nothing)."""
  params = model.init(jax.random.PRNGKey(1), x, keep)["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  noisy = [leaf + 0.3 * jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys)]
  return jax.tree.unflatten(tree, noisy)


def test_per_position_time_equal_everywhere_is_per_sequence_time():
  model = _network()
  x = jax.random.randint(jax.random.PRNGKey(0), (3, LENGTH), 0, VOCAB)
  alpha = jnp.array([0.2, 0.5, 0.9])
  params = _random_params(model, x, alpha)
  per_row = model.apply({"params": params}, x, alpha)
  per_position = model.apply({"params": params}, x, jnp.repeat(alpha[:, None], LENGTH, 1))
  np.testing.assert_allclose(per_position, per_row, rtol=1e-5, atol=1e-5)
  other = model.apply({"params": params}, x, alpha.at[0].set(0.6))
  assert not np.allclose(other[0], per_row[0], atol=1e-3)  # Time is read.


def test_the_two_stream_pass_equals_a_call_per_block_and_a_cached_block():
  model = _network()
  x = jax.random.randint(jax.random.PRNGKey(0), (3, LENGTH), 0, VOCAB)
  z = jax.random.randint(jax.random.PRNGKey(5), (3, LENGTH), 0, VOCAB)
  keep = jnp.repeat(jnp.array([[0.3, 0.8], [0.5, 0.1], [0.9, 0.6]]), BLOCK, axis=1)
  params = _random_params(model, x, keep)
  pair = model.apply({"params": params}, z, keep, clean=x)
  assert pair.shape == (3, LENGTH, VOCAB)
  block_of = jnp.arange(LENGTH) // BLOCK
  for block in range(LENGTH // BLOCK):
    shown = jnp.where(block_of < block, x, z)
    known = jnp.where(block_of < block, 1.0, jnp.where(block_of == block, keep, 0.0))
    one = model.apply({"params": params}, shown, known)
    inside = np.asarray(block_of == block)
    np.testing.assert_allclose(pair[:, inside], one[:, inside], rtol=2e-5, atol=2e-5)
  # Block 1 against block 0's keys and values, written at keep 1 (a clean block).
  positions = jnp.broadcast_to(jnp.arange(BLOCK), (3, BLOCK))
  denoiser = Denoiser.of_network(model, params)
  layout = denoiser.cache_layout
  _, written = denoiser.block_call(x[:, :BLOCK], jnp.ones(3), positions, layout.empty(3, 0))
  cache = {**written, "valid": jnp.ones(BLOCK, bool)}
  cached, _ = denoiser.block_call(z[:, BLOCK:], keep[:, BLOCK], positions + BLOCK, cache)
  np.testing.assert_allclose(pair[:, BLOCK:], cached, rtol=2e-5, atol=2e-5)


def test_a_two_stream_pass_of_a_timed_network_needs_per_position_time():
  model = _network()
  x = jnp.zeros((2, LENGTH), jnp.int32)
  with pytest.raises(ValueError, match=r"alpha \[B, L\]"):
    model.init(jax.random.PRNGKey(0), x, jnp.ones(2), clean=x)


# ---------------------------------------------------------------- the sampler
SAMPLE_VOCAB, SAMPLE_LENGTH, P_VALUE = 3, 4, 1e-4


@pytest.fixture(scope="module")
def small_chain():
  chain = groundtruth.MarkovLanguage(SAMPLE_VOCAB, seed=3)
  every = np.array(list(itertools.product(range(SAMPLE_VOCAB), repeat=SAMPLE_LENGTH)), np.int32)
  return chain, np.exp(np.asarray(chain.log_prob(jnp.asarray(every)), np.float64))


def _chi_square_p(tokens, law):
  index = (np.asarray(tokens) * SAMPLE_VOCAB ** np.arange(SAMPLE_LENGTH - 1, -1, -1)).sum(-1)
  counts = np.bincount(index, minlength=law.size)
  expected = law * counts.sum()
  small = expected < 5.0
  counts = np.append(counts[~small], counts[small].sum())
  expected = np.append(expected[~small], expected[small].sum())
  statistic = np.sum((counts - expected) ** 2 / expected)
  return stats.chi2.sf(statistic, len(counts) - 1)


def _block_samples(chain, block_size, num_steps, n=10000, **kwargs):
  tokens, info = md4jax.sample(
    jax.random.PRNGKey(7),
    chain.uniform_denoise_fn(),
    batch_size=n,
    length=SAMPLE_LENGTH,
    schedule="linear",
    num_steps=num_steps,
    process="uniform",
    block_size=block_size,
    **kwargs,
  )
  return np.asarray(tokens), info


def test_blocks_of_one_token_draw_the_chain_in_one_step_each(small_chain):
  """b = 1, T = 1: each token drawn from p(x_i | x_<i), autoregressive sampling: exact only if
  every call reads the blocks before as clean and the later positions as noise."""
  chain, law = small_chain
  tokens, info = _block_samples(chain, 1, 1)
  assert int(info["nfe"]) == SAMPLE_LENGTH and int(info["num_blocks"]) == SAMPLE_LENGTH
  assert _chi_square_p(tokens, law) > P_VALUE
  # The control: blocks of 2 in one step draw a block's tokens independently, not the chain.
  tokens, _ = _block_samples(chain, 2, 1)
  assert _chi_square_p(tokens, law) < 1e-6


def test_greedy_tail_in_blocks_of_one_token_decodes_the_chain_greedily(small_chain):
  """b = 1, T = 1, greedy_tail: each block's one step takes the most probable token given the
  blocks before, so every row is the chain's greedy path."""
  chain, _ = small_chain
  tokens, _ = _block_samples(chain, 1, 1, n=64, method="greedy_tail")
  path = [int(np.argmax(chain.initial))]
  for _ in range(SAMPLE_LENGTH - 1):
    path.append(int(np.argmax(chain.transition[path[-1]])))
  np.testing.assert_array_equal(tokens, np.broadcast_to(path, tokens.shape))


def test_blocks_with_many_steps_draw_the_chain(small_chain):
  chain, law = small_chain
  tokens, info = _block_samples(chain, 2, 256)
  assert int(info["nfe"]) == 2 * 256
  assert _chi_square_p(tokens, law) > P_VALUE


def test_a_prompt_is_kept_and_conditions_the_blocks(small_chain):
  chain, _ = small_chain
  prompt = jnp.array([2, 0])
  tokens, _ = _block_samples(chain, 1, 1, n=4000, prompt=prompt)
  np.testing.assert_array_equal(tokens[:, :2], np.broadcast_to([2, 0], (4000, 2)))
  transition = np.asarray(chain.transition, np.float64)
  counts = np.bincount(tokens[:, 2], minlength=SAMPLE_VOCAB)
  assert stats.chisquare(counts, transition[0] * counts.sum()).pvalue > P_VALUE


@pytest.mark.parametrize("method", ["ancestral", "greedy_tail", "canvas"])
def test_the_exact_cache_samples_what_a_call_per_block_samples(method):
  model = _network()
  x = jnp.zeros((2, LENGTH), jnp.int32)
  params = _random_params(model, x, jnp.ones((2, LENGTH)))
  denoiser = Denoiser.of_network(model, params)
  common = dict(
    batch_size=6,
    length=LENGTH,
    schedule="linear",
    num_steps=8,
    process="uniform",
    method=method,
    block_size=BLOCK,
    prompt=jnp.array([1, 3]),
  )
  key = jax.random.PRNGKey(9)
  none, none_info = md4jax.sample(key, denoiser, cache="none", **common)
  exact, exact_info = md4jax.sample(key, denoiser, cache="exact", **common)
  np.testing.assert_array_equal(exact, none)
  np.testing.assert_array_equal(np.asarray(exact)[:, :2], np.broadcast_to([1, 3], (6, 2)))
  assert int(exact_info["nfe"]) == int(none_info["nfe"]) == 2 * 8
  assert int(exact_info["cache_writes"]) == 2 and exact_info["cache_bytes"] > 0
  assert int(none_info["cache_writes"]) == 0
  assert len(np.unique(np.asarray(exact)[:, 2:], axis=0)) > 1  # Rows differ: a real draw.


def test_one_block_draws_the_same_through_the_decoder_and_without_it():
  """A network of one block of L: the plain sampler, and the block decoder's route (cache
  "exact", an empty cache) draw the same tokens from one key."""
  model = _network(block_size=LENGTH)
  x = jnp.zeros((2, LENGTH), jnp.int32)
  denoiser = Denoiser.of_network(model, _random_params(model, x, jnp.ones(2)))
  common = dict(batch_size=6, length=LENGTH, schedule="linear", num_steps=8, process="uniform")
  key = jax.random.PRNGKey(10)
  plain, plain_info = md4jax.sample(key, denoiser, **common)
  decoded, info = md4jax.sample(key, denoiser, block_size=LENGTH, cache="exact", **common)
  assert "num_blocks" not in plain_info and int(info["num_blocks"]) == 1
  np.testing.assert_array_equal(plain, decoded)


def test_the_training_pass_and_the_reference_path_estimate_one_bound():
  """A random network: the one-pass estimator (two streams) and the call-per-block bound agree
  within their SEs (both unbiased for the same bound, independent draws)."""
  model = _network()
  x = jax.random.randint(jax.random.PRNGKey(0), (4000, LENGTH), 0, VOCAB)
  params = _random_params(model, x[:2], jnp.ones((2, LENGTH)))
  schedule = schedules.get_schedule("linear")

  def trusting(logits, z, keep):
    """A fifth of the network's logits plus log(1 + V α/(1 − α)) on the token seen (with no
    network, the exact posterior of uniform random tokens): a random network alone doubts clean
    tokens at small t, where the integrand is ~1/t and the estimates' variance unbounded."""
    keep = jnp.minimum(keep if keep.ndim == 2 else keep[:, None], 0.999)
    trust = jnp.log1p(VOCAB * keep / (1 - keep))[..., None] * jax.nn.one_hot(z, VOCAB)
    return 0.2 * logits + trust

  one_pass = uniform.one_pass_block_nelbo(
    jax.random.PRNGKey(1),
    lambda z, clean, keep: trusting(model.apply({"params": params}, z, keep, clean=clean), z, keep),
    x,
    schedule,
    BLOCK,
  )
  reference = bounds.nelbo(
    jax.random.PRNGKey(2),
    lambda z, keep: trusting(model.apply({"params": params}, z, keep), z, keep),
    x,
    schedule,
    process="uniform",
    block_size=BLOCK,
  )
  one_pass, reference = (np.asarray(a, np.float64) for a in (one_pass, reference))
  se = np.sqrt(one_pass.var(ddof=1) / one_pass.size + reference.var(ddof=1) / reference.size)
  assert abs(one_pass.mean() - reference.mean()) < 4 * se, (one_pass.mean(), reference.mean(), se)
  assert se < 0.03 * reference.mean()  # A block weighted 25% off (of 2) would show.


# ---------------------------------------------------------------- the trainer's objective
def test_the_objective_trains_uniform_blocks_in_one_pass_and_refuses_hidden_positions():
  config = config_lib.load_config("default:uniform_bd3")
  config.model.update(num_layers=1, model_dim=32, num_heads=2, mlp_dim=64)
  config_lib.validate_config(config, num_devices=1)
  model = state_lib.build_model(config)
  assert model.block_size == 16 and model.time_conditioning == "adaln"
  tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 64), 0, config.data.vocab_size)
  params = model.init(jax.random.PRNGKey(1), tokens, jnp.ones(4))["params"]
  batch = {"tokens": tokens, "segment_ids": None, "positions": None, "editable": tokens >= 0}
  rows = dict(model=model, config=config, row_index=jnp.arange(4), num_rows=4)

  def loss(params):
    return objective.training_loss(params, batch, jax.random.PRNGKey(2), **rows)[0].mean()

  value, grads = jax.value_and_grad(loss)(params)
  assert np.isfinite(value) and value > 0
  modulation = [g for path, g in jax.tree_util.tree_leaves_with_path(grads) if "adaln" in str(path)]
  assert modulation and max(float(jnp.abs(g).max()) for g in modulation) > 0  # Time is read.
  score = functools.partial(
    objective.sequence_nats, params, batch, jax.random.PRNGKey(3), model=model, config=config
  )
  discrete = score(estimator="standard", t_sampling="stratified", num_steps=4)  # Reference path.
  assert discrete.shape == (4,) and np.all(np.isfinite(discrete)) and np.all(discrete > 0)
  with pytest.raises(ValueError, match="hidden positions need the masked process"):
    score(estimator="standard", t_sampling="stratified", hidden=jnp.zeros_like(tokens, bool))
