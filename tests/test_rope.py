"""Tests for md4jax.model.rope: relative positions, the host table, out-of-range positions."""

import jax
import jax.numpy as jnp
import numpy as np

from md4jax.model.rope import apply_rope, rope_cos_sin


def test_rope_relative_position():
  dh = 16
  kq, kk = jax.random.split(jax.random.key(0))
  q = jax.random.normal(kq, (1, 1, dh))  # [L=1, H=1, Dh]
  k = jax.random.normal(kk, (1, 1, dh))

  def score(m, n):
    return jnp.sum(apply_rope(q, jnp.array([m])) * apply_rope(k, jnp.array([n])))

  # Same offset m - n at different absolute positions -> same score.
  np.testing.assert_allclose(score(3, 1), score(103, 101), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(score(0, 0), score(57, 57), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(score(0, 0), jnp.sum(q * k), rtol=1e-5, atol=1e-5)
  # A different offset gives a different score (the test is not vacuous).
  assert abs(float(score(3, 1) - score(1, 3))) > 1e-3
  # Rotation preserves norms; output dtype follows input.
  x = apply_rope(q, jnp.array([7]))
  np.testing.assert_allclose(jnp.linalg.norm(x), jnp.linalg.norm(q), rtol=1e-5)
  assert apply_rope(q.astype(jnp.bfloat16), jnp.array([7])).dtype == jnp.bfloat16


def test_rope_table_gives_the_computed_rotation():
  positions = jnp.asarray([[0, 5, 127, 64], [3, 3, 1, 100]], jnp.int32)
  looked_up = rope_cos_sin(positions, 64, num_positions=128)
  computed = rope_cos_sin(positions, 64)
  # The table: float64 cos and sin of the float32 angles, within an ulp.
  frequencies = 10000.0 ** (-np.arange(32, dtype=np.float32) / np.float32(32))
  angles = (np.asarray(positions, np.float32)[..., None] * frequencies).astype(np.float64)
  for table, direct, exact in zip(looked_up, computed, (np.cos(angles), np.sin(angles))):
    assert table.shape == direct.shape == (2, 4, 32)
    ulp = np.spacing(np.abs(exact).astype(np.float32))
    assert np.all(np.abs(np.asarray(table, np.float64) - exact) <= ulp)
    np.testing.assert_allclose(np.asarray(table), np.asarray(direct), rtol=0, atol=2e-6)
  # Out of range, under jit: NaN, never the angle of another position.
  outside = jax.jit(lambda p: rope_cos_sin(p, 64, num_positions=128))(jnp.asarray([0, -1, 128]))
  assert np.isfinite(np.asarray(outside[0][0])).all()
  assert np.isnan(np.asarray(outside[0][1:])).all() and np.isnan(np.asarray(outside[1][1:])).all()
