"""The block decoder's contract: a Denoiser's params travel as arguments (one compile for any
number of fresh param trees, none kept alive), AR decoding is b = 1 with the exact cache, grouped
key/value heads are cached once each, and EOS ends a row."""

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md4jax
from md4jax.diffusion import groundtruth, schedules
from md4jax.diffusion.denoiser import Denoiser
from md4jax.model.transformer import Transformer
from md4jax.sampling import arguments, decoder

VOCAB = 6
MASK_ID = VOCAB
LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # One per program jit builds.


def _network(**kwargs):
  model = Transformer(
    vocab_size=VOCAB, num_layers=2, model_dim=32, num_heads=4, mlp_dim=64, **kwargs
  )
  return model, lambda seed: model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 8), jnp.int32))[
    "params"
  ]


class _Lowerings:
  """Counts the programs jax lowers while it is open (jax.monitoring's compile events)."""

  def __enter__(self):
    self.count, self.open = 0, True

    def listen(event, duration, **kwargs):
      del duration, kwargs
      if self.open and event == LOWERING:
        self.count += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    return self

  def __exit__(self, *exc_info):
    self.open = False  # jax.monitoring keeps its listeners; this one stops counting.


class _Holder:
  """A denoiser as an object's method."""

  def __init__(self, denoiser):
    self.denoiser = denoiser

  def denoise(self, z, alpha):
    return self.denoiser(z, alpha)


def _apply(model, params, z, alpha):
  return model.apply({"params": params}, z, alpha)


def _sample(denoise_fn, key=0, **kwargs):
  common = dict(
    batch_size=3,
    length=8,
    schedule=schedules.get_schedule("linear"),
    mask_id=MASK_ID,
    method="ancestral",
    num_steps=4,
  )
  return md4jax.sample(jax.random.PRNGKey(key), denoise_fn, **{**common, **kwargs})


def test_fresh_params_of_one_shape_compile_once():
  model, init = _network()
  param_trees = [init(seed) for seed in range(10)]
  jax.block_until_ready(param_trees)
  with _Lowerings() as lowered:
    samples = [_sample(Denoiser.of_network(model, params))[0] for params in param_trees]
  assert lowered.count == 1
  assert len({np.asarray(s).tobytes() for s in samples}) > 1  # The params did change the draws.
  # A bound method is made anew at each access, yet it is one function: one program.
  holder = _Holder(Denoiser.of_network(model, param_trees[0]))
  with _Lowerings() as lowered:
    for key in range(3):
      _sample(holder.denoise, key=key)
  assert lowered.count == 1
  # A new closure over each tree is a new program each time: what a Denoiser avoids.
  with _Lowerings() as lowered:
    for params in param_trees[:3]:
      _sample(lambda z, a, params=params: model.apply({"params": params}, z, a))
  assert lowered.count == 3


def test_the_compiled_program_keeps_no_params_alive():
  model, init = _network()
  params = init(0)
  leaf = weakref.ref(jax.tree.leaves(params)[0])
  _sample(Denoiser.of_network(model, params))
  del params
  gc.collect()
  assert leaf() is None
  # A closure's programs (its params baked in) live as long as the closure, no longer.
  params, programs = init(1), len(decoder._PLAIN_PROGRAMS)  # pylint: disable=protected-access
  leaf = weakref.ref(jax.tree.leaves(params)[0])
  closure = functools.partial(_apply, model, params)
  with _Lowerings() as lowered:
    _sample(closure), _sample(closure, key=1)
  assert lowered.count == 1  # The same closure: compiled once.
  del closure, params
  gc.collect()
  assert leaf() is None and len(decoder._PLAIN_PROGRAMS) == programs  # pylint: disable=protected-access


def test_a_jitted_caller_compiles_once_with_the_denoiser_as_an_argument():
  model, init = _network()
  run = jax.jit(lambda key, denoiser: _sample(denoiser, key=0, length=8)[0])
  run(0, Denoiser.of_network(model, init(0)))
  with _Lowerings() as lowered:
    for seed in range(1, 4):
      run(0, Denoiser.of_network(model, init(seed)))
  assert lowered.count == 0


def test_ar_decoding_is_one_token_blocks_with_the_exact_cache():
  # A causal network read shifted ([BOS, x_0, ...]) predicts each token from the ones before it.
  model, init = _network(causal=True)
  ar = Denoiser.of_network(model, jax.tree.map(lambda p: 3 * p, init(0)), shift_id=MASK_ID)
  common = dict(method="first_hitting", block_size=1, length=8, batch_size=16)
  cached, info = _sample(ar, cache="exact", **common)
  rerun, rerun_info = _sample(ar, cache="none", **common)
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(rerun))
  assert int(info["nfe"]) == 8 and int(info["cache_writes"]) == 0  # One call a token.
  assert len({tuple(row) for row in np.asarray(cached)}) > 1
  greedy, _ = _sample(ar, cache="exact", **common, temperature=0.0, prompt=jnp.asarray([2]))
  logits = ar(greedy, None)
  np.testing.assert_array_equal(np.asarray(greedy)[:, 1:], np.argmax(logits, -1)[:, 1:])


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_the_cache_holds_each_key_value_head_once(num_kv_heads):
  model, init = _network(block_size=4, num_kv_heads=num_kv_heads)
  denoiser = Denoiser.of_network(model, init(0))
  tokens, info = _sample(denoiser, block_size=4, cache="exact", length=16, context_length=12)
  head_dim, slots = 32 // 4, 12 - 4
  assert info["cache_bytes"] == 2 * 2 * 3 * slots * num_kv_heads * head_dim * 4
  assert info["cache_bytes"] == denoiser.cache_layout.bytes(3, slots)
  window, _ = _sample(
    lambda z, a: model.apply({"params": init(0)}, z, a), block_size=4, length=16, context_length=12
  )
  np.testing.assert_array_equal(np.asarray(tokens)[:, :12], np.asarray(window)[:, :12])


@pytest.mark.parametrize("block_size", [None, 4])
def test_eos_ends_each_row_and_the_rest_is_eos(block_size):
  language = groundtruth.MarkovLanguage(VOCAB, seed=1)
  # The last position is given (infilling): EOS fills what was generated, never a given token.
  prompt = jnp.full((16,), MASK_ID, jnp.int32).at[15].set(3)
  tokens, info = _sample(
    language.denoise_fn(MASK_ID),
    eos_id=0,
    block_size=block_size,
    length=16,
    batch_size=64,
    prompt=prompt,
  )
  tokens, lengths = np.asarray(tokens), np.asarray(info["lengths"])
  ended = lengths < 16
  assert ended.any() and not ended.all()
  for row, length in zip(tokens, lengths):
    assert 0 not in row[: length - 1] and np.all(row[length:15] == 0) and row[15] == 3
    assert length == 16 or row[length - 1] == 0


def test_caches_refuse_what_they_cannot_serve():
  language = groundtruth.MarkovLanguage(VOCAB, seed=1)
  with pytest.raises(ValueError, match="caches a network's keys and values"):
    _sample(language.denoise_fn(MASK_ID), cache="exact", block_size=4)
  model, init = _network()
  with pytest.raises(ValueError, match="needs a network whose blocks never read later ones"):
    _sample(Denoiser.of_network(model, init(0)), cache="exact", block_size=4)
  with pytest.raises(ValueError, match="record_trajectory records one block"):
    _sample(language.denoise_fn(MASK_ID), block_size=4, record_trajectory=True)
  with pytest.raises(ValueError, match="eos_id must be a token id"):
    _sample(language.denoise_fn(MASK_ID), eos_id=MASK_ID)
  with pytest.raises(ValueError, match="prompt has 2 rows; give 1 or batch_size=3"):
    _sample(language.denoise_fn(MASK_ID), prompt=jnp.zeros((2, 4), jnp.int32))
  # NumPy integers count as integers.
  tokens, info = _sample(
    language.denoise_fn(MASK_ID), num_steps=np.int64(4), block_size=np.int64(4)
  )
  assert tokens.shape == (3, 8) and int(info["num_blocks"]) == 2


def test_blocks_before_a_given_token_draw_the_exact_conditional():
  """A window shows a later given token (infilling in blocks): with the exact oracle, each block
  drawn by first_hitting from exact conditionals, the blocks before a given last token x_7 = c
  draw p(x | x_7 = c). Its x_6 marginal is π(a) T(a, c) / π(c) (the chain is stationary)."""
  language = groundtruth.MarkovLanguage(VOCAB, seed=1)
  c, n = 2, 4000
  prompt = jnp.full((8,), MASK_ID, jnp.int32).at[7].set(c)
  tokens, info = _sample(
    language.denoise_fn(MASK_ID),
    method="first_hitting",
    block_size=2,
    length=8,
    batch_size=n,
    prompt=prompt,
  )
  tokens = np.asarray(tokens)
  assert int(info["num_blocks"]) == 4 and np.all(tokens[:, 7] == c)
  exact = language.initial * language.transition[:, c]
  exact = exact / exact.sum()
  counts = np.bincount(tokens[:, 6], minlength=VOCAB)
  stderr = np.sqrt(exact * (1 - exact) / n)
  np.testing.assert_array_less(np.abs(counts / n - exact), 4 * stderr + 1e-12)
  # Without the given token shown, x_6 would follow the stationary law instead: the test tells.
  assert np.abs(language.initial - exact).max() > 8 * stderr.max()


def test_blocks_after_the_prompt():
  """block_offset starts the blocks at the prompt's end (LLaDA's semi-AR decoding): one block
  after the prompt is the plain one-block sample; blocks of 2 after a 3-token prompt reveal the
  generated positions block after block; the exact cache, or a prompt narrower than the offset,
  is refused."""
  model, init = _network()
  denoiser = Denoiser.of_network(model, init(0))
  prompt = jnp.asarray([[1, 2, 3]] * 3, jnp.int32)
  kwargs = dict(method="confidence", temperature=0.0, prompt=prompt, reveal_counts="even")
  whole, _ = _sample(denoiser, **kwargs)
  after, info = _sample(denoiser, block_offset=3, **kwargs)
  np.testing.assert_array_equal(after, whole)
  assert int(info["num_blocks"]) == 1
  tokens, info = _sample(denoiser, block_offset=3, block_size=2, **kwargs)
  assert int(info["num_blocks"]) == 3 and tokens.shape == (3, 8)  # Blocks [3, 5), [5, 7), [7, 9).
  np.testing.assert_array_equal(tokens[:, :3], prompt)
  assert (np.asarray(tokens) < VOCAB).all()
  with pytest.raises(ValueError, match="the exact cache's blocks are the network's own"):
    _sample(denoiser, block_offset=3, block_size=2, cache="exact", **kwargs)
  with pytest.raises(ValueError, match="after a prompt at least that wide"):
    _sample(denoiser, block_offset=4, block_size=2, **kwargs)
  with pytest.raises(ValueError, match="block_offset must lie in"):
    _sample(denoiser, block_offset=8, **kwargs)


def test_block_offset_errors_name_one_condition_each():
  model, init = _network()
  denoiser = Denoiser.of_network(model, init(0))
  prompt = jnp.asarray([[1, 2, 3]] * 3, jnp.int32)
  cases = {
    r"block_offset=3 takes cache none, prefix or dual; .* \(got cache='exact'\)\.$": dict(
      block_offset=3, cache="exact", prompt=prompt
    ),
    r"block_offset=3 starts the blocks after the prompt, and no prompt is given": dict(
      block_offset=3
    ),
    r"block_offset=4 starts the blocks after a prompt at least that wide; the prompt is 3 wide": (
      dict(block_offset=4, prompt=prompt)
    ),
  }
  for message, kwargs in cases.items():
    with pytest.raises(ValueError, match=message) as raised:
      _sample(denoiser, block_size=2, **kwargs)
    assert "got 'none'" not in str(raised.value) and "\n" not in str(raised.value)


def test_a_traced_prompt_masked_before_the_blocks_is_reported_not_returned_silently():
  """Under jit the prompt is not concrete: the positions before block_offset it leaves masked
  (sampled by no block: the mask id) are counted in info, which check_filled raises on."""
  model, init = _network()
  denoiser = Denoiser.of_network(model, init(0))
  holed = jnp.asarray([[1, 2, MASK_ID, 3]] * 3, jnp.int32)
  run = jax.jit(lambda prompt: _sample(denoiser, prompt=prompt, block_offset=4, block_size=2))
  tokens, info = jax.device_get(run(holed))
  assert (tokens[:, 2] == MASK_ID).all() and int(info["unfilled"]) == 3
  with pytest.raises(ValueError, match="3 positions before block_offset were neither given"):
    arguments.check_filled(info)
  tokens, info = jax.device_get(run(jnp.asarray([[1, 2, 4, 3]] * 3, jnp.int32)))
  assert int(info["unfilled"]) == 0 and (tokens < VOCAB).all()
  arguments.check_filled(info)
  with pytest.raises(ValueError, match="leaves positions before it masked"):  # Concrete: before.
    _sample(denoiser, prompt=holed, block_offset=4, block_size=2)
  _, info = _sample(denoiser, block_size=2)
  assert "unfilled" not in info  # No offset: the info is as it was.


def test_shifted_logits_refuse_the_caches_and_windows_of_one_block():
  """Dream's shift_logits takes a block's first logits from the position before it: the caches
  run a block alone, and a window of context_length = block_size holds no position before it."""
  model, init = _network(shift_logits=True)
  denoiser = Denoiser.of_network(model, init(0))
  for cache in ("exact", "prefix", "dual"):
    with pytest.raises(ValueError, match=f"cache='{cache}' runs each block alone, but the netw"):
      _sample(denoiser, cache=cache, block_size=4)
  with pytest.raises(ValueError, match="context_length = block_size = 4 leaves out"):
    _sample(denoiser, block_size=4, context_length=4)
  with pytest.raises(ValueError, match="context_length = block_size = 4 leaves out"):
    _sample(denoiser, block_size=4, context_length=4, block_offset=2, prompt=jnp.ones(2, int))
  tokens, info = _sample(denoiser, block_size=4, context_length=8)
  assert int(info["num_blocks"]) == 2 and (np.asarray(tokens) < VOCAB).all()
  _sample(denoiser, block_size=8, context_length=8)  # One block: position 0 keeps its own.
