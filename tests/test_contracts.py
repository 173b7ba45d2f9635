"""chex contracts at the public boundaries: the math runs the same jitted and not jitted, and a
wrong shape or dtype fails when traced, naming the argument."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from md4jax.diffusion import bounds, groundtruth, schedules
from md4jax.model.transformer import Transformer
from md4jax.sampling import decoder

VOCAB, LENGTH = 5, 8


class MathVariantsTest(chex.TestCase):
  """The same numbers with and without jit (chex.variants)."""

  def setUp(self):
    super().setUp()
    self.language = groundtruth.MarkovLanguage(VOCAB, seed=0)
    self.x = self.language.sample(jax.random.PRNGKey(0), 64, LENGTH)

  @chex.variants(with_jit=True, without_jit=True)
  def test_schedule_values(self):
    t = jnp.linspace(0.05, 1.0, 20)
    for name in ("linear", "cosine", "poly2", "loglinear"):
      schedule = schedules.get_schedule(name)
      alpha, weight = self.variant(lambda t, s=schedule: (s.alpha(t), s.weight(t)))(t)
      chex.assert_trees_all_close(
        (alpha, weight), (schedule.alpha(t), schedule.weight(t)), rtol=1e-6
      )

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("standard", "mask_count")
  def test_nelbo_is_the_same_number(self, estimator):
    denoise = self.language.denoise_fn(VOCAB)
    nelbo = lambda key, x: bounds.nelbo(
      key, denoise, x, schedules.get_schedule("linear"), mask_id=VOCAB, estimator=estimator
    )
    value = self.variant(nelbo)(jax.random.PRNGKey(1), self.x)
    chex.assert_shape(value, (64,))
    chex.assert_trees_all_close(value, jax.jit(nelbo)(jax.random.PRNGKey(1), self.x), rtol=1e-5)
    chex.assert_tree_all_finite(value)

  @chex.variants(with_jit=True, without_jit=True)
  def test_corrupt_keeps_shapes_and_visible_tokens(self):
    z = self.variant(lambda key, x: bounds.corrupt(key, x, 0.5, mask_id=VOCAB))(
      jax.random.PRNGKey(2), self.x
    )
    chex.assert_equal_shape((z, self.x))
    np.testing.assert_array_equal(np.where(z != VOCAB, z, self.x), self.x)

  @chex.variants(with_jit=True, without_jit=True)
  def test_sampler_draws_valid_tokens_and_keeps_the_prompt(self):
    denoise = self.language.denoise_fn(VOCAB)
    prompt = jnp.array([1, 2] + [VOCAB] * (LENGTH - 2))
    tokens, _ = self.variant(
      lambda key: decoder.sample(
        key,
        denoise,
        batch_size=4,
        length=LENGTH,
        schedule=schedules.get_schedule("linear"),
        mask_id=VOCAB,
        method="ancestral",
        num_steps=4,
        prompt=prompt,
      )
    )(jax.random.PRNGKey(3))
    chex.assert_shape(tokens, (4, LENGTH))
    assert (np.asarray(tokens)[:, :2] == [1, 2]).all() and (np.asarray(tokens) < VOCAB).all()


def _oracle(unused=None):
  return groundtruth.MarkovLanguage(VOCAB, seed=0).denoise_fn(VOCAB)


@pytest.mark.parametrize(
  "call, message",
  [
    (
      lambda: bounds.corrupt(
        jax.random.PRNGKey(0), jnp.zeros((LENGTH,), jnp.int32), 0.5, mask_id=VOCAB
      ),
      "corrupt: x must be clean tokens",
    ),
    (
      lambda: bounds.corrupt(jax.random.PRNGKey(0), jnp.zeros((2, LENGTH)), 0.5, mask_id=VOCAB),
      "corrupt: x must be integer token ids",
    ),
    (
      lambda: bounds.corrupt(
        jax.random.PRNGKey(0), jnp.zeros((2, LENGTH), jnp.int32), jnp.ones(3), mask_id=VOCAB
      ),
      "corrupt: alpha_t must be \\[B\\]",
    ),
    (
      lambda: bounds.nelbo(
        jax.random.PRNGKey(0),
        _oracle(None),
        jnp.zeros((2, LENGTH), jnp.int32),
        "linear",
        mask_id=VOCAB,
        editable=jnp.ones((2, LENGTH + 1), bool),
      ),
      "nelbo: editable must have x's shape",
    ),
    (
      lambda: bounds.nelbo(
        jax.random.PRNGKey(0),
        lambda z, a: jnp.zeros(z.shape[:1] + (VOCAB,)),
        jnp.zeros((2, LENGTH), jnp.int32),
        "linear",
        mask_id=VOCAB,
      ),
      "must return logits \\[B, L, V\\]",
    ),
    (
      lambda: decoder.sample(
        jax.random.PRNGKey(0),
        _oracle(None),
        batch_size=2,
        length=LENGTH,
        schedule=schedules.get_schedule("linear"),
        mask_id=VOCAB,
        num_steps=2,
        prompt=jnp.zeros((LENGTH + 1,), jnp.int32),
      ),
      "sample: prompt must be \\[P\\] or \\[batch_size, P\\] with P <= length",
    ),
    (
      lambda: schedules.get_schedule("cosine").alpha(jnp.arange(3)),
      "Cosine.alpha\\(t\\): t must be float",
    ),
    (
      lambda: Transformer(VOCAB, 1, 8, 2, 16).init(jax.random.PRNGKey(0), jnp.zeros((2, 4))),
      "Transformer: tokens must be integer ids",
    ),
  ],
)
def test_a_wrong_shape_or_dtype_names_the_argument(call, message):
  with pytest.raises(AssertionError, match=message):
    jax.jit(call)() if "Transformer" in message else call()
