"""The model's weight matmuls: a matmul with the gradient XLA:CPU runs best, for `md4jax.model.transformer`."""

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


def _projection_dims(x_ndim: int, num_in: int):
  """(token dims of x, its contracted dims): x [tokens..., *in] · kernel [*in, *out]."""
  return tuple(range(x_ndim - num_in)), tuple(range(x_ndim - num_in, x_ndim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def project(x, kernel, num_in: int):
  """x [..., *in] · kernel [*in, *out] -> [..., *out], contracting x's last num_in dims.

  The gradient is the matmul's own. The kernel's is x · g contracted over the token dims,
  computed as g · x and transposed when the kernel's output is the smaller side: XLA:CPU
  copies the operand it contracts first into a transposed layout, so that is the smaller of
  x and g. (JAX's transpose of an einsum always computes g · x and transposes it: the larger
  g was copied, and the gradient again for the optimizer.) Reverse mode only, as a custom_vjp.
  """
  _, contracted = _projection_dims(x.ndim, num_in)
  return jax.lax.dot_general(x, kernel, ((contracted, tuple(range(num_in))), ((), ())))


def _project_forward(x, kernel, num_in):
  return project(x, kernel, num_in), (x, kernel)


def _project_backward(num_in, residuals, g):
  x, kernel = residuals
  tokens, _ = _projection_dims(x.ndim, num_in)
  num_out = kernel.ndim - num_in
  dx = jax.lax.dot_general(
    g, kernel, ((tuple(range(len(tokens), g.ndim)), tuple(range(num_in, kernel.ndim))), ((), ()))
  )
  if math.prod(kernel.shape[num_in:]) >= math.prod(kernel.shape[:num_in]):
    dkernel = jax.lax.dot_general(x, g, ((tokens, tokens), ((), ())))
  else:
    dkernel_t = jax.lax.dot_general(g, x, ((tokens, tokens), ((), ())))  # [*out, *in]
    dkernel = jnp.transpose(dkernel_t, tuple(range(num_out, kernel.ndim)) + tuple(range(num_out)))
  return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


project.defvjp(_project_forward, _project_backward)

PROJECTION = "projection"  # The name remat's "save_dots" policy keeps `project`'s outputs by.


def named_projection(x, kernel, num_in: int):
  """`project`, its output named PROJECTION for remat policies."""
  return checkpoint_name(project(x, kernel, num_in), PROJECTION)
