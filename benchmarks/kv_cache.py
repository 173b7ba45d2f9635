r"""The block decoder's exact KV cache for grouped-query attention: bytes held at num_kv_heads, against
the num_heads copies a cache of repeated heads holds, printed as one JSON object.

  python benchmarks/kv_cache.py                  # Llama-3-8B's shape (GQA 4:1), bfloat16
  python benchmarks/kv_cache.py --num_layers=24 --num_heads=14 --num_kv_heads=2 --head_dim=64

The bytes come from the decoder itself: a small network of the same heads (2 layers) samples with
cache="exact" and reports info["cache_bytes"], checked against the layout's formula
2 · layers · rows · slots · heads · head_dim · itemsize, which then gives the full-size figures.
"""

import json

import jax
import jax.numpy as jnp
from absl import app, flags

import md4jax
from md4jax.diffusion.denoiser import CacheLayout
from md4jax.model.transformer import Transformer

_NUM_LAYERS = flags.DEFINE_integer("num_layers", 32, "Transformer blocks (Llama-3-8B: 32).")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 32, "Query heads (Llama-3-8B: 32).")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 8, "Key/value heads (Llama-3-8B: 8).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Per-head width (Llama-3-8B: 128).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "The cache's dtype (the compute dtype).")
_SHAPES = flags.DEFINE_list(
  "shapes", ["1x4096x32", "8x4096x32", "64x2048x32"], "batch x context x block of each row."
)


def _measured_bytes(num_kv_heads: int) -> tuple[int, int]:
  """(info["cache_bytes"] of a 2-layer network with these heads, the layout's formula for it)."""
  heads, head_dim, block, context, batch = _NUM_HEADS.value, 8, 4, 16, 3
  model = Transformer(
    vocab_size=7,
    num_layers=2,
    model_dim=heads * head_dim,
    num_heads=heads,
    mlp_dim=32,
    num_kv_heads=num_kv_heads,
    block_size=block,
    dtype=jnp.dtype(_DTYPE.value),
  )
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, context), jnp.int32))["params"]
  _, info = md4jax.sample(
    jax.random.PRNGKey(1),
    md4jax.Denoiser.of_network(model, params),
    batch_size=batch,
    length=2 * context,
    block_size=block,
    cache="exact",
    context_length=context,
    schedule=md4jax.get_schedule("linear"),
    mask_id=7,
    method="first_hitting",
  )
  layout = CacheLayout(2, num_kv_heads, head_dim, jnp.dtype(_DTYPE.value), block, False)
  return int(info["cache_bytes"]), layout.bytes(batch, context - block)


def main(argv):
  del argv
  measured, formula = _measured_bytes(_NUM_KV_HEADS.value)
  assert measured == formula, (measured, formula)
  dtype = jnp.dtype(_DTYPE.value)
  at = lambda kv_heads: CacheLayout(_NUM_LAYERS.value, kv_heads, _HEAD_DIM.value, dtype, 0, True)
  rows = []
  for shape in _SHAPES.value:
    batch, context, block = (int(v) for v in shape.split("x"))
    slots = context - block
    repeated, grouped = at(_NUM_HEADS.value), at(_NUM_KV_HEADS.value)
    rows.append(
      {
        "batch": batch,
        "context": context,
        "block": block,
        "repeated_heads_bytes": repeated.bytes(batch, slots),
        "kv_heads_bytes": grouped.bytes(batch, slots),
        "ratio": repeated.bytes(batch, slots) / grouped.bytes(batch, slots),
      }
    )
  print(
    json.dumps(
      {
        "num_layers": _NUM_LAYERS.value,
        "num_heads": _NUM_HEADS.value,
        "num_kv_heads": _NUM_KV_HEADS.value,
        "head_dim": _HEAD_DIM.value,
        "dtype": _DTYPE.value,
        "decoder_cache_bytes_checked": measured,
        "rows": rows,
      },
      indent=2,
    )
  )


if __name__ == "__main__":
  app.run(main)
