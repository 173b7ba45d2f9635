"""LoRA adapters (Hu et al. 2021) on the network's attention and MLP projections, and the helpers
that fold them into the base kernels, pick them out of a params tree and count them.

A projection with model.lora_rank r > 0 computes x · (W + (alpha / r) · A · B): beside its
`kernel` W [*in, *out] it holds `lora_a` A [*in, r] (PEFT's init) and `lora_b` B [r, *out]
(zeros), so at init the network is the base one exactly and a base checkpoint's params keep
their names and shapes. docs/lora.md.
"""

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

LORA_A, LORA_B = "lora_a", "lora_b"  # The adapter params beside a projection's "kernel".
ADAPTER_NAMES = (LORA_A, LORA_B)
# The logical name of the rank axis: in no sharding rule, so replicated (r is a handful).
RANK_AXIS = "lora_rank"
# lora_alpha's default everywhere it is a field (Projection, SwiGLU, Attention, Block, Transformer)
# and in config.model: one default, so a layer used alone with lora_rank > 0 scales as a run does.
DEFAULT_ALPHA = 16.0


def scale(rank: int, alpha: float) -> float:
  """The update's factor alpha / rank (PEFT's lora_alpha / r); ValueError unless rank > 0 and
  alpha > 0 (alpha 0 would make every adapter a no-op that still trains)."""
  if not rank > 0 or not alpha > 0:
    raise ValueError(
      f"LoRA needs lora_rank > 0 and lora_alpha > 0 (the update is scaled by lora_alpha / "
      f"lora_rank), got lora_rank={rank!r}, lora_alpha={alpha!r}."
    )
  return alpha / rank


def adapter_init(num_in: int):
  """A's initializer over its num_in input dims: PEFT's kaiming_uniform(a=√5), uniform in
  ±1/√fan_in (variance 1/(3 fan_in)), so x · A starts at the scale of the projection's input."""
  return nn.initializers.variance_scaling(
    1.0 / 3.0, "fan_in", "uniform", in_axis=tuple(range(num_in)), out_axis=-1
  )


def is_adapter(path) -> bool:
  """Whether a param's key path (a flat tuple of names, or jax's key path) is inside an adapter."""
  return any(str(getattr(key, "key", key)) in ADAPTER_NAMES for key in path)


def _flat(params) -> dict:
  return flax.traverse_util.flatten_dict(flax.core.unfreeze(params))


def adapters(params) -> dict:
  """The adapter params alone (the same nested names), {} for a tree without any."""
  return flax.traverse_util.unflatten_dict(
    {path: leaf for path, leaf in _flat(params).items() if is_adapter(path)}
  )


def without_adapters(params) -> dict:
  """params without any adapter entry: the base tree."""
  return flax.traverse_util.unflatten_dict(
    {path: leaf for path, leaf in _flat(params).items() if not is_adapter(path)}
  )


def with_adapters(params, new_adapters) -> dict:
  """The base tree `params` with `new_adapters` (an `adapters` tree) beside its kernels."""
  return flax.traverse_util.unflatten_dict({**_flat(params), **_flat(new_adapters)})


def has_adapters(params) -> bool:
  return any(is_adapter(path) for path in _flat(params))


def _update(a, b, kernel_ndim: int):
  """A · B contracted over the rank, [lead..., *in, *out] with the kernel's leading (scanned
  "layers") axes batched."""
  lead = a.ndim + b.ndim - 2 - kernel_ndim
  product = lambda a, b: jnp.tensordot(a, b, axes=1, precision=jax.lax.Precision.HIGHEST)
  for _ in range(lead):
    product = jax.vmap(product)
  return product(a, b)


def merge(params, factor: float) -> Any:
  """params with every adapter folded into its kernel, W + factor · A · B, and none left."""
  flat = _flat(params)
  merged_flat = {}
  for path, leaf in flat.items():
    if is_adapter(path):
      continue
    parent = path[:-1]
    if path[-1] == "kernel" and parent + (LORA_A,) in flat:
      a, b = flat[parent + (LORA_A,)], flat[parent + (LORA_B,)]
      update = _update(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), leaf.ndim)
      leaf = (jnp.asarray(leaf, jnp.float32) + factor * update).astype(leaf.dtype)
    merged_flat[path] = leaf
  return flax.traverse_util.unflatten_dict(merged_flat)


def merged(params, config) -> Any:
  """Base-shaped params of a run's `config` (its model.lora_rank and lora_alpha): every adapter
  folded into its kernel (W + (alpha / r) · A · B) and no adapter entries left, what a rank-0
  config reads and export writes. params without adapters come back as they are."""
  if not has_adapters(params):
    return params
  rank = config.model.lora_rank
  if rank <= 0:
    raise ValueError(
      f"model.lora_rank={rank!r}: these params hold LoRA adapters, so their run's rank is > 0."
    )
  return merge(params, scale(rank, config.model.lora_alpha))


def count_trainable(params) -> int:
  """The scalars a run trains: the adapters' when params hold any (a LoRA run; a learned
  schedule's θ, kept apart from the network's params, aside), else every one."""
  chosen = adapters(params) if has_adapters(params) else params
  return int(sum(leaf.size for leaf in jax.tree.leaves(chosen)))
