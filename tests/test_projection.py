"""Tests for md4jax.model.projection: the matmul and its custom gradient against jnp.einsum's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md4jax.model.projection import project


# The first kernel's output is its larger side (its gradient is x · g), the second's its
# smaller (g · x, transposed).
@pytest.mark.parametrize(
  "equation, x_shape, kernel_shape, num_in",
  [
    ("bld,dthk->blthk", (2, 5, 6), (6, 3, 2, 4), 1),
    ("blhk,hkd->bld", (2, 5, 3, 4), (3, 4, 6), 2),
  ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_projection_gradients_are_the_einsums(equation, x_shape, kernel_shape, num_in, dtype):
  kx, kk, kc = jax.random.split(jax.random.key(0), 3)
  x, kernel = (
    jax.random.normal(k, shape).astype(dtype) for k, shape in ((kx, x_shape), (kk, kernel_shape))
  )
  cotangent = jax.random.normal(kc, jnp.einsum(equation, x, kernel).shape).astype(dtype)
  ours = jax.jit(jax.grad(lambda x, w: jnp.sum(project(x, w, num_in) * cotangent), (0, 1)))(
    x, kernel
  )
  einsum = jax.grad(lambda x, w: jnp.sum(jnp.einsum(equation, x, w) * cotangent), (0, 1))(x, kernel)
  tolerance = 1e-5 if dtype == jnp.float32 else 5e-2
  assert project(x, kernel, num_in).dtype == dtype
  np.testing.assert_allclose(
    np.asarray(project(x, kernel, num_in), np.float32),
    np.asarray(jnp.einsum(equation, x, kernel), np.float32),
    rtol=tolerance,
    atol=tolerance,
  )
  for got, want in zip(ours, einsum):
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tolerance, atol=tolerance
    )
