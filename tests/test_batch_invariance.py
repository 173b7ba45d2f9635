"""Batch-invariant sampling: row r of a request draws from fold_in(key, r) alone, so its tokens
are the same whatever the batch size, the other rows, or which slice of the request a call
samples (row_offset): bit for bit, for every method and cache, with prompts per row, and with
left-padded prompts read through a Denoiser's segment_ids and positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import md4jax
from md4jax.diffusion import schedules
from md4jax.diffusion.denoiser import Denoiser
from md4jax.model.transformer import Transformer

VOCAB = 6
MASK_ID = VOCAB
LENGTH, BLOCK, BATCH = 8, 4, 8
LINEAR = schedules.get_schedule("linear")

METHODS = {
  "ancestral": dict(method="ancestral", num_steps=3),
  "confidence": dict(method="confidence", num_steps=3),
  "confidence_cold_top_p": dict(method="confidence", num_steps=3, temperature=0.7, top_p=0.9),
  "threshold": dict(method="threshold", threshold=0.4),
  "first_hitting": dict(method="first_hitting"),
  "remdm": dict(method="remdm", num_steps=4, remask_eta=0.3),
}
MORE_METHODS = {  # Cheap with a plain function: the rest of the methods and settings.
  "cached": dict(method="cached", num_steps=6),
  "jump": dict(method="jump", num_steps=6),
  "remdm_loop": dict(method="remdm", num_steps=6, remask_eta=0.3, remask_loop=2),
  "confidence_drawn_even": dict(
    method="confidence", num_steps=3, confidence="drawn_prob", reveal_counts="even"
  ),
  "confidence_top_k_proportional": dict(
    method="confidence",
    num_steps=3,
    top_k=3,
    confidence="drawn_filtered_prob",
    reveal_counts="proportional",
  ),
  "ancestral_float32_noise": dict(method="ancestral", num_steps=3, noise="float32"),
}


def _network(block_size=0):
  model = Transformer(
    vocab_size=VOCAB,
    num_layers=2,
    model_dim=32,
    num_heads=2,
    mlp_dim=64,
    block_size=block_size,
    weight_init="fan_in",
  )
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, LENGTH), jnp.int32))["params"]
  return model, jax.tree.map(lambda p: 2.0 * p, params)  # Sharper than the init's.


@pytest.fixture(scope="module")
def bidirectional():
  return _network()


@pytest.fixture(scope="module")
def block_causal():
  return _network(BLOCK)


def _plain(z, alpha):
  """A time-conditioned denoiser that reads the whole row, row by row, without matmuls."""
  position = jnp.arange(z.shape[1])[None, :, None]
  vocab = jnp.arange(VOCAB)[None, None, :]
  context = jnp.sum(jnp.where(z == MASK_ID, 0.0, z + 1.0), axis=1)[:, None, None]
  return 3.0 * jnp.sin(1.3 * vocab + 0.7 * z[..., None] + 0.3 * position + 0.1 * context) + alpha[
    :, None, None
  ] * jnp.cos(vocab)


def _time_free(z, alpha):
  """_plain at α = 0: what "cached" is exact for (it reuses logits across steps, and a batch calls
  the network whenever any row needs it)."""
  return _plain(z, jnp.zeros_like(alpha))


def _tokens(denoiser, key=None, **kwargs):
  key = jax.random.PRNGKey(7) if key is None else key
  settings = dict(length=LENGTH, schedule=LINEAR, mask_id=MASK_ID)
  return np.asarray(md4jax.sample(key, denoiser, **{**settings, **kwargs})[0])


def _assert_rows_alone(denoiser, prompts=None, **kwargs):
  """Each row of a batch of BATCH equals the batch-1 call at its row offset (with its own prompt
  when `prompts` [BATCH, P] is given)."""
  batch = _tokens(denoiser, batch_size=BATCH, prompt=prompts, **kwargs)
  assert len({tuple(row) for row in batch}) > 1  # The rows did draw differently.
  for row in range(BATCH):
    prompt = None if prompts is None else prompts[row : row + 1]
    alone = _tokens(denoiser, batch_size=1, row_offset=row, prompt=prompt, **kwargs)
    np.testing.assert_array_equal(alone[0], batch[row], err_msg=f"row {row}")


@pytest.mark.parametrize("name", list(METHODS) + list(MORE_METHODS))
def test_plain_function_rows_do_not_depend_on_the_batch(name):
  settings = {**METHODS, **MORE_METHODS}[name]
  denoiser = _time_free if settings["method"] == "cached" else _plain
  _assert_rows_alone(denoiser, **settings)
  _assert_rows_alone(denoiser, block_size=BLOCK, **settings)


@pytest.mark.parametrize(
  "cache,network",
  [
    ("none", "bidirectional"),
    ("none", "block_causal"),
    ("exact", "block_causal"),
    ("dual", "bidirectional"),
  ],
)
@pytest.mark.parametrize("name", list(METHODS))
def test_network_rows_do_not_depend_on_the_batch(request, name, cache, network):
  """A network's logits are the same at any batch size up to float32 rounding (XLA's CPU
  matmuls and attention sum in another order for another batch: |Δ| ~ 1e-5 here), which moves
  no draw. But where every position reads only masks, every position's logits are the same
  number and confidence ranks them by that rounding alone (0.8638935 vs 0.8638941 at batch 8
  and 1): the confidence methods get one prompt token per row, so their ranks are the
  network's."""
  model, params = request.getfixturevalue(network)
  prompts = _prompts(3, width=1) if METHODS[name]["method"] == "confidence" else None
  _assert_rows_alone(
    Denoiser.of_network(model, params), prompts, block_size=BLOCK, cache=cache, **METHODS[name]
  )


def _prompts(seed, width=3):
  """[BATCH, width] prompts, every row its own."""
  return np.random.default_rng(seed).integers(0, VOCAB, (BATCH, width)).astype(np.int32)


@pytest.mark.parametrize(
  "name",
  ["ancestral", pytest.param("confidence_cold_top_p", marks=pytest.mark.slow), "first_hitting"],
)
def test_a_row_with_its_own_prompt_is_the_row_alone(block_causal, bidirectional, name):
  settings = METHODS[name]
  prompts = _prompts(1)
  _assert_rows_alone(_plain, prompts, block_size=BLOCK, **settings)
  _assert_rows_alone(_plain, prompts, guidance_scale=1.5, **settings)
  model, params = block_causal
  denoiser = Denoiser.of_network(model, params)
  _assert_rows_alone(denoiser, prompts, block_size=BLOCK, cache="exact", **settings)
  model, params = bidirectional
  denoiser = Denoiser.of_network(model, params)
  _assert_rows_alone(
    denoiser, prompts, block_size=BLOCK, cache="dual", guidance_scale=1.0, **settings
  )


def test_eos_and_the_state_dependent_schedule_keep_rows_apart():
  # EOS: rows end in different blocks; the batch runs on until every row ended.
  _assert_rows_alone(_plain, block_size=2, eos_id=0, **METHODS["ancestral"])
  tokenpoly = schedules.get_schedule("tokenpoly", exponents=jnp.linspace(0.5, 2.0, VOCAB))
  _assert_rows_alone(_plain, method="ancestral", num_steps=4, schedule=tokenpoly)


def test_row_offset_samples_a_slice_of_the_request(block_causal):
  model, params = block_causal
  for denoiser, cache in ((_plain, "none"), (Denoiser.of_network(model, params), "exact")):
    settings = dict(block_size=BLOCK, cache=cache, **METHODS["confidence_cold_top_p"])
    whole = _tokens(denoiser, batch_size=8, **settings)
    rows_3_4 = _tokens(denoiser, batch_size=2, row_offset=3, **settings)
    np.testing.assert_array_equal(rows_3_4, whole[3:5])
  # Under the caller's jit the offset may be traced: one program for every slice.
  sliced = jax.jit(
    lambda offset: md4jax.sample(
      jax.random.PRNGKey(7),
      _plain,
      batch_size=2,
      length=LENGTH,
      schedule=LINEAR,
      mask_id=MASK_ID,
      row_offset=offset,
      **METHODS["ancestral"],
    )[0]
  )
  whole = _tokens(_plain, batch_size=8, **METHODS["ancestral"])
  np.testing.assert_array_equal(np.asarray(sliced(3)), whole[3:5])


def _left_padded(lengths, generated, pad_id=0, seed=2):
  """Prompts of `lengths` left-padded to the longest: (prompt [B, P], prompt_mask, inputs
  {"segment_ids", "positions"} [B, P + generated], the unpadded prompts)."""
  width = max(lengths)
  rng = np.random.default_rng(seed)
  own = [rng.integers(0, VOCAB, n).astype(np.int32) for n in lengths]
  prompt = np.full((len(lengths), width), pad_id, np.int32)
  for row, tokens in enumerate(own):
    prompt[row, width - len(tokens) :] = tokens
  real = np.arange(width + generated)[None] >= (width - np.asarray(lengths))[:, None]
  segment_ids = real.astype(np.int32)
  positions = np.maximum(np.cumsum(real, axis=1) - 1, 0).astype(np.int32)  # 0 on the padding.
  inputs = {"segment_ids": segment_ids, "positions": positions}
  return prompt, np.ones_like(prompt, bool), inputs, own


@pytest.mark.parametrize("name", ["ancestral", "confidence_cold_top_p", "remdm"])
def test_left_padded_rows_are_the_rows_alone(bidirectional, name):
  """Mixed prompt lengths left-padded to one width, the padding hidden by segment 0 and the
  positions restarting at each row's first real token: each row equals its batch-1 call."""
  model, params = bidirectional
  generated = 6
  lengths = [1, 3, 2, 4, 4, 1, 2, 3]
  prompt, given, inputs, _ = _left_padded(lengths, generated)
  length = prompt.shape[1] + generated
  for block_size in (None, BLOCK):  # Blocks of 4 over 10 tokens: the inputs are continued.
    settings = dict(length=length, block_size=block_size, **METHODS[name])
    batch = _tokens(
      Denoiser.of_network(model, params, inputs=inputs),
      batch_size=BATCH,
      prompt=prompt,
      prompt_mask=given,
      **settings,
    )
    for row in range(BATCH):
      alone = _tokens(
        Denoiser.of_network(model, params, inputs={k: v[row : row + 1] for k, v in inputs.items()}),
        batch_size=1,
        row_offset=row,
        prompt=prompt[row : row + 1],
        prompt_mask=given[row : row + 1],
        **settings,
      )
      np.testing.assert_array_equal(alone[0], batch[row], err_msg=f"row {row}")


def test_left_padding_is_invisible_to_greedy_decoding(bidirectional):
  """Greedy confidence decoding draws nothing at random: a left-padded row generates what its
  unpadded prompt alone generates, so the network reads the inputs, not the padding."""
  model, params = bidirectional
  generated = 6
  lengths = [1, 3, 2, 4]
  prompt, given, inputs, own = _left_padded(lengths, generated)
  settings = dict(method="confidence", num_steps=3, temperature=0.0)
  padded = _tokens(
    Denoiser.of_network(model, params, inputs=inputs),
    batch_size=len(lengths),
    length=prompt.shape[1] + generated,
    prompt=prompt,
    prompt_mask=given,
    **settings,
  )
  ignored = _tokens(  # Without the inputs the padding is read as tokens: other continuations.
    Denoiser.of_network(model, params),
    batch_size=len(lengths),
    length=prompt.shape[1] + generated,
    prompt=prompt,
    prompt_mask=given,
    **settings,
  )
  assert np.any(ignored[:, -generated:] != padded[:, -generated:])
  for row, tokens in enumerate(own):
    alone = _tokens(
      Denoiser.of_network(model, params),
      batch_size=1,
      length=len(tokens) + generated,
      prompt=tokens,
      **settings,
    )
    np.testing.assert_array_equal(padded[row, -generated:], alone[0, -generated:])


def test_inputs_serve_cache_none_only(block_causal):
  model, params = block_causal
  inputs = {"segment_ids": np.ones((1, LENGTH), np.int32)}
  denoiser = Denoiser.of_network(model, params, inputs=inputs)
  with pytest.raises(ValueError, match="read with cache='none' only, got cache='exact'"):
    _tokens(denoiser, batch_size=2, block_size=BLOCK, cache="exact", **METHODS["ancestral"])
  wrong = Denoiser.of_network(model, params, inputs={"segment_ids": np.ones((1, 5), np.int32)})
  with pytest.raises(ValueError, match=r"inputs\['segment_ids'\] must be \[1 or batch_size=2"):
    _tokens(wrong, batch_size=2, **METHODS["ancestral"])
  unknown = Denoiser.of_network(model, params, inputs={"mask": np.ones((1, LENGTH), np.int32)})
  with pytest.raises(ValueError, match="inputs must be a dict of positions, segment_ids"):
    _tokens(unknown, batch_size=2, **METHODS["ancestral"])


def test_bad_keys_and_offsets_are_refused():
  with pytest.raises(ValueError, match="key must be one PRNG key"):
    _tokens(
      _plain, key=jax.random.split(jax.random.PRNGKey(0), 2), batch_size=2, **METHODS["ancestral"]
    )
  for offset in (-1, 1.5, True, "3"):
    with pytest.raises(ValueError, match="row_offset must be an integer >= 0"):
      _tokens(_plain, batch_size=2, row_offset=offset, **METHODS["ancestral"])


@pytest.mark.parametrize("name", ["ancestral", "confidence_cold_top_p", "remdm"])
def test_rows_split_over_two_devices_equal_one_device(name):
  """The batch sharded over two devices (the prompt's rows split, as a mesh's data axis splits
  them) samples the same tokens as one device, bit for bit."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  if jax.device_count() < 2:
    pytest.skip("needs 2 devices (tests/conftest.py gives 8 CPU devices)")
  prompt = jnp.asarray(np.arange(BATCH * 2).reshape(BATCH, 2) % VOCAB, jnp.int32)

  def run(prompt):
    return md4jax.sample(
      jax.random.PRNGKey(5),
      _plain,
      batch_size=BATCH,
      length=LENGTH,
      schedule=LINEAR,
      mask_id=MASK_ID,
      prompt=prompt,
      **METHODS[name],
    )[0]

  alone = np.asarray(jax.jit(run)(prompt))
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
  rows = NamedSharding(mesh, PartitionSpec("data", None))
  split = jax.jit(run, in_shardings=rows, out_shardings=rows)(jax.device_put(prompt, rows))
  assert len(split.sharding.device_set) == 2
  np.testing.assert_array_equal(np.asarray(split), alone)
