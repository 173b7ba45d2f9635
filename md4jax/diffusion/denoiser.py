"""The denoiser as a pytree: its arrays are leaves and the function that reads them is static.

`sample` and `nelbo` call any `denoise_fn(z [B, L], time [B]) -> logits [B, L, V]`. A closure
over params is such a function, but it hides the params from jax.jit: each new closure is a new
program, compiled again, and kept with the params it closes over. A `Denoiser` passes them as
arguments instead, so a jitted caller compiles once per shape and setting:

  denoiser = md4jax.Denoiser.of_network(model, params)        # a Transformer and its params
  denoiser = md4jax.Denoiser(lambda p, z, t: f(p, z, t), params)   # any apply function

The apply function (and a network) is compared by equality when jit looks up its cache: a
module-level function, a Flax module or a frozen dataclass, not a lambda made anew per call.

A self-conditioned network (model.self_condition) also reads an estimate of x_0: called as
denoise_fn(z, time, previous=probabilities [B, L, V]) by a sampler that passes its last step's
estimate on (the uniform-state samplers always; the masked ones with passes=1); called without
one, it reads its own first call's estimate of the same z (passes=2, the default: the bound's
model, two network calls a masked sampler step) or none (passes=1).

A network denoiser also gives the block decoder (`md4jax.sampling.decoder`) what its KV caches
need: `block_call` runs the network on one block that reads cached keys and values, and
`cache_layout` their shapes.
"""

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """What a network's KV cache holds per cached position: keys and values [N, rows, C, Hkv, Dh],
  and which positions its attention lets a block read (block_size: block-causal; causal)."""

  num_layers: int
  num_kv_heads: int
  head_dim: int
  dtype: Any
  block_size: int
  causal: bool

  def shape(self, rows: int, slots: int) -> tuple:
    return (self.num_layers, rows, slots, self.num_kv_heads, self.head_dim)

  def bytes(self, rows: int, slots: int) -> int:
    """Bytes of the keys and values of `slots` positions of `rows` rows."""
    size = 1
    for dim in self.shape(rows, slots):
      size *= dim
    return 2 * size * jnp.dtype(self.dtype).itemsize

  def empty(self, rows: int, slots: int) -> dict:
    zeros = jnp.zeros(self.shape(rows, slots), self.dtype)
    return {"k": zeros, "v": zeros, "valid": jnp.zeros((slots,), bool)}


_CACHE_ATTRIBUTES = ("num_layers", "num_heads", "num_kv_heads", "model_dim", "block_size", "causal")


def caches_keys_and_values(network) -> bool:
  """Whether network is a Transformer-like module whose calls take a KV cache (md4jax's
  `Transformer` declares its layout; a model that only has apply, such as a test's oracle, not)."""
  return network is not None and all(hasattr(network, name) for name in _CACHE_ATTRIBUTES)


@dataclasses.dataclass(frozen=True)
class _Plain:
  """A plain denoise_fn(z, time) as an apply function without params."""

  denoise_fn: Callable

  def __call__(self, params, z, time, previous=None):
    del params
    if previous is None:
      return self.denoise_fn(z, time)
    return self.denoise_fn(z, time, previous=previous)

  @property
  def self_condition(self) -> bool:
    return bool(getattr(self.denoise_fn, "self_condition", False))


def shifted_inputs(tokens: Array, bos_id: int, positions: Optional[Array] = None) -> Array:
  """[BOS, x_0, ..., x_{L-2}]: position i reads the token before it. With positions [B, L]
  (packed documents), each document starts from BOS, never from its predecessor's end."""
  inputs = jnp.concatenate([jnp.full_like(tokens[:, :1], bos_id), tokens[:, :-1]], axis=1)
  return inputs if positions is None else jnp.where(positions == 0, bos_id, inputs)


def _rows_of(layout, rows: int):
  """layout [B', L] repeated to `rows` rows (guidance calls on [z; z with the prompt masked])."""
  if layout is None or layout.shape[0] == rows:
    return layout
  return jnp.tile(layout, (rows // layout.shape[0], 1))


@dataclasses.dataclass(frozen=True)
class Denoiser:
  """denoise_fn(z, time) -> logits whose params are pytree leaves (the module docstring).

  apply_fn(params, z, time) -> logits, or, with `network` set (a Transformer), the network
  itself: network.apply({"params": params}, tokens, time, segment_ids, positions) where tokens
  are z or, with shift_id, [shift_id, z_0, ..., z_{L-2}] (shifted prediction: position i's output
  predicts token i from the positions before it; an AR model, or Dream's), time is
  time_of(time) when given (a network conditioned on t instead of α), and segment_ids and
  positions [B, L] are `inputs`' (rows that end in padding), or none.
  """

  apply_fn: Optional[Callable] = None  # Static.
  params: Any = None  # Leaves.
  network: Any = None  # Static.
  inputs: Optional[dict] = None  # Leaves: {"segment_ids", "positions"} [B, L], or None.
  shift_id: Optional[int] = None  # Static.
  time_of: Optional[Callable] = None  # Static.
  # A self-conditioned network's calls without an estimate: 2 read its own first call's estimate
  # of the same z (the model its bound scores), 1 reads none (a training step's first pass; a
  # masked sampler then hands each call the last one's estimate, one call a step); ignored by a
  # network that is not self-conditioned. Static.
  passes: int = 2

  def __post_init__(self):
    if (self.apply_fn is None) == (self.network is None):
      raise ValueError("Denoiser takes an apply_fn or a network, exactly one of them.")
    if self.passes not in (1, 2):
      raise ValueError(f"Denoiser passes must be 1 or 2, got {self.passes!r}.")

  @classmethod
  def of_network(
    cls, network, params, *, shift_id=None, time_of=None, inputs=None, passes=2
  ) -> "Denoiser":
    """The denoiser of a Transformer (or any module with its apply signature) and its params."""
    return cls(None, params, network, inputs, shift_id, time_of, passes)

  @property
  def self_conditioned(self) -> bool:
    """Whether the network also reads an estimate of x_0 (model.self_condition): called as
    denoise_fn(z, time, previous=probabilities [B, L, V])."""
    model = self.apply_fn if self.network is None else self.network
    return bool(getattr(model, "self_condition", False))

  def __call__(self, z: Array, time: Array, previous: Optional[Array] = None) -> Array:
    if previous is None and self.passes == 2 and self.self_conditioned:
      previous = jax.lax.stop_gradient(estimate(self._call(z, time, None)))
    return self._call(z, time, previous)

  def _call(self, z, time, previous):
    if previous is not None and not self.self_conditioned:
      raise ValueError("denoise_fn: previous (an estimate of x_0) needs a self-conditioned model.")
    if self.network is None:
      if previous is None:
        return self.apply_fn(self.params, z, time)
      return self.apply_fn(self.params, z, time, previous)
    extra = {} if previous is None else {"previous": previous}
    inputs = self.inputs or {}
    segments = _rows_of(inputs.get("segment_ids"), z.shape[0])
    positions = _rows_of(inputs.get("positions"), z.shape[0])
    tokens = z if self.shift_id is None else shifted_inputs(z, self.shift_id, positions)
    time = time if self.time_of is None else self.time_of(time)
    return self.network.apply({"params": self.params}, tokens, time, segments, positions, **extra)

  @property
  def shifts_logits(self) -> bool:
    """Whether the network takes position i's logits from its output at i − 1 (Dream's
    shift_logits; position 0 keeps its own): a block's first position reads the one before it."""
    return bool(getattr(self.network, "shift_logits", False))

  @property
  def cache_layout(self) -> Optional[CacheLayout]:
    """The KV cache's layout of a network denoiser without per-row inputs (None: no cache; a
    network with shift_logits has none either: a cached call runs its block alone)."""
    if not caches_keys_and_values(self.network) or self.inputs is not None:
      return None
    if self.shifts_logits:  # Reads the position before the block.
      return None
    if self.self_conditioned:  # A block call reads no estimate.
      return None
    net = self.network
    return CacheLayout(
      num_layers=net.num_layers,
      num_kv_heads=net.num_kv_heads or net.num_heads,
      head_dim=net.model_dim // net.num_heads,
      dtype=net.dtype,
      block_size=net.block_size,
      causal=net.causal,
    )

  def block_call(self, tokens: Array, time: Array, positions: Array, cache: dict):
    """(logits, the block's keys and values) of tokens [R, b] as the network reads them (already
    shifted), at positions [R, b], reading the valid cached positions of cache."""
    time = time if self.time_of is None else self.time_of(time)
    return self.network.apply(
      {"params": self.params}, tokens, time, positions=positions, cache=cache
    )


jax.tree_util.register_dataclass(
  Denoiser,
  data_fields=["params", "inputs"],
  meta_fields=["apply_fn", "network", "shift_id", "time_of", "passes"],
)


def estimate(logits: Array) -> Array:
  """A self-conditioned network's input: the probabilities of its estimate of x_0, float32."""
  return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)


def self_conditioned(denoise_fn) -> bool:
  """Whether denoise_fn reads an estimate of x_0: a `Denoiser` of a self-conditioned network, or
  a callable with self_condition = True that takes previous= (`as_denoiser` wraps it)."""
  return as_denoiser(denoise_fn).self_conditioned


def as_denoiser(denoise_fn) -> Denoiser:
  """A Denoiser as it is; any other callable denoise_fn(z, time) as a static one."""
  if isinstance(denoise_fn, Denoiser):
    return denoise_fn
  if not callable(denoise_fn):
    raise TypeError(f"denoise_fn must be callable, got {type(denoise_fn).__name__}.")
  return Denoiser(_Plain(denoise_fn))
