"""MD4's text-network params -> md4jax's `Transformer` params under model.preset = "md4".

MD4 (google-deepmind/md4, md4/models/backward.py and md4/networks/transformer.py)
keeps its denoiser under "classifier": a time MLP (CondEmbedding_0), the token
embedding (Embed_0) and Transformer_0, whose blocks hold per-head-flat q/k/v/o
kernels, the MLP's w1 (gate), w3 (up), w2 (down) and one adaLN projection each.
Its LayerNorms have no params. `from_md4` maps that tree onto md4jax's names
and layouts:

  CondEmbedding_0/dense0, Dense_0    -> time_in, time_out
  Embed_0                            -> embed
  Transformer_0/Dense_0              -> embed_proj (its bias included)
  TransformerBlock_i/attention/w*    -> block_i/attn/qkv [D, 3, H, Dh], out [H, Dh, D]
  TransformerBlock_i/feed_forward/w* -> block_i/mlp/gate, down, up
  TransformerBlock_i/Dense_0         -> block_i/adaln
  Transformer_0/Dense_1, Dense_2     -> final_adaln, logits

RoPE: MD4 rotates the interleaved pairs (x[2i], x[2i+1]) of a head, md4jax the
halves (x[i], x[i + Dh/2]) (`md4jax.model.rope`), both at frequency i. Reordering
each head's q and k columns to [0, 2, 4, ..., 1, 3, 5, ...] makes the second
compute the first; the attention scores q·k do not see the order.
"""

import jax
import numpy as np


def rope_permutation(head_dim: int) -> np.ndarray:
  """The q/k column order of a head that turns MD4's interleaved RoPE pairs into md4jax's halves."""
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head dim, got {head_dim}.")
  return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def _dense(tree: dict, path: str) -> dict:
  """The kernel (and bias, when there is one) of the Dense at `path` in MD4's tree."""
  node = tree
  for part in path.split("/"):
    if not hasattr(node, "keys") or part not in node:
      raise ValueError(
        f"MD4 params have no {path!r} (missing {part!r}): from_md4 expects MD4's "
        "time-conditioned text network (md4/configs/md4/text8.py's choices)."
      )
    node = node[part]
  return {name: np.asarray(node[name]) for name in ("kernel", "bias") if name in node}


def from_md4(md4_params: dict, num_heads: int, scan_layers: bool = False) -> dict:
  """md4jax params (numpy arrays) from MD4's `params` collection (with or without its
  "classifier" level), for a Transformer with num_heads heads; scan_layers stacks the blocks
  as model.scan_layers does (under blocks/block, layer axis first)."""
  tree = md4_params["classifier"] if "classifier" in md4_params else md4_params
  net = _dense(tree, "Transformer_0/Dense_0")  # The embedding projection: [E, D].
  model_dim = net["kernel"].shape[1]
  if model_dim % num_heads:
    raise ValueError(f"MD4's width {model_dim} is not divisible by num_heads={num_heads}.")
  head_dim = model_dim // num_heads
  perm = rope_permutation(head_dim)
  blocks = sorted(
    (k for k in tree["Transformer_0"] if k.startswith("TransformerBlock_")),
    key=lambda k: int(k.rsplit("_", 1)[1]),
  )
  if not blocks:
    raise ValueError("MD4 params have no Transformer_0/TransformerBlock_*: not MD4's text network.")
  out = {
    "embed": {"embedding": np.asarray(tree["Embed_0"]["embedding"])},
    "embed_proj": net,
    "time_in": _dense(tree, "CondEmbedding_0/dense0"),
    "time_out": _dense(tree, "CondEmbedding_0/Dense_0"),
    "final_adaln": _dense(tree, "Transformer_0/Dense_1"),
    "logits": _dense(tree, "Transformer_0/Dense_2"),
  }
  converted = []
  for name in blocks:
    prefix = f"Transformer_0/{name}"
    heads = lambda w, prefix=prefix: _dense(tree, f"{prefix}/attention/{w}")["kernel"].reshape(
      model_dim, num_heads, head_dim
    )
    qkv = np.stack([heads("wq")[..., perm], heads("wk")[..., perm], heads("wv")], axis=1)
    wo = _dense(tree, f"{prefix}/attention/wo")["kernel"].reshape(num_heads, head_dim, model_dim)
    mlp = lambda w, prefix=prefix: _dense(tree, f"{prefix}/feed_forward/{w}")
    converted.append(
      {
        "attn": {"qkv": {"kernel": qkv}, "out": {"kernel": wo}},
        "mlp": {"gate": mlp("w1"), "up": mlp("w3"), "down": mlp("w2")},
        "adaln": _dense(tree, f"{prefix}/Dense_0"),
      }
    )
  if scan_layers:
    out["blocks"] = {"block": jax.tree.map(lambda *layers: np.stack(layers), *converted)}
  else:
    out.update({f"block_{i}": block for i, block in enumerate(converted)})
  return out
