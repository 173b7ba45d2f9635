"""top_k with top_p: md4jax filters as Dream's sample_tokens does (top-p of the whole distribution,
then top-k), not as transformers' generate (top-k, then top-p of what is left)."""

import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.sampling import categorical


def _kept(logits, **filters):
  return np.isfinite(np.asarray(categorical.filter_logits(jnp.asarray(logits), **filters)))


def test_top_p_is_taken_before_top_k():
  logits = np.log([[0.3, 0.29, 0.21, 0.2]])
  # The nucleus of .5 is {.3, .29} (.3 < .5 before the second); top-2 keeps both. Top-2 first
  # would leave [.3, .29] / .59, whose nucleus of .5 is the first alone (.508 >= .5).
  np.testing.assert_array_equal(_kept(logits, top_k=2, top_p=0.5), [[True, True, False, False]])
  # Each filter alone, as before.
  np.testing.assert_array_equal(_kept(logits, top_k=2), [[True, True, False, False]])
  np.testing.assert_array_equal(_kept(logits, top_p=0.5), [[True, True, False, False]])
  # k smaller than the nucleus: k of it.
  np.testing.assert_array_equal(_kept(logits, top_k=1, top_p=0.5), [[True, False, False, False]])
  # The nucleus smaller than k: the nucleus.
  np.testing.assert_array_equal(_kept(logits, top_k=3, top_p=0.2), [[True, False, False, False]])


def _dream_kept(logits, top_k, top_p):
  """Dream's sample_tokens filters (generation_utils.py: top_p_logits, then top_k_logits), in
  NumPy: which entries stay finite."""
  order = np.argsort(-logits, axis=-1, kind="stable")
  sorted_logits = np.take_along_axis(logits, order, -1)
  probs = np.exp(sorted_logits - sorted_logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  remove = np.cumsum(probs, -1) > top_p
  remove[..., 1:] = remove[..., :-1].copy()
  remove[..., 0] = False
  filtered = logits.copy()
  np.put_along_axis(filtered, order, np.where(remove, -np.inf, sorted_logits), -1)
  kth = np.sort(filtered, -1)[..., -top_k][..., None]
  return np.isfinite(np.where(filtered < kth, -np.inf, filtered))


@pytest.mark.parametrize("top_k, top_p", [(2, 0.5), (5, 0.9), (20, 0.3), (3, 0.99)])
def test_the_filters_keep_what_dreams_keep(top_k, top_p):
  logits = np.random.default_rng(top_k).normal(0.0, 2.0, (16, 32)).astype(np.float32)
  np.testing.assert_array_equal(
    _kept(logits, top_k=top_k, top_p=top_p), _dream_kept(logits, top_k, top_p)
  )
