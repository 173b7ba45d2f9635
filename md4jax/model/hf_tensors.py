"""Hugging Face Llama, Qwen2, LLaDA and Dream weights <-> md4jax `Transformer` params.

`to_md4jax` and `from_md4jax` move the tensors, for the model options md4jax.model.hf_config
reads (torch's Linear weights are [out, in], md4jax's kernels [in, out] with the heads split
out). `layout` says where each tensor goes, tensor by tensor: `to_md4jax` (everything in memory)
and md4jax.app.hf's streamed import (one tensor at a time, through `Assembler`) both follow it:

  model.embed_tokens.weight [V, D]            -> embed/embedding [V + 1, D] (the mask row added)
  lm_head.weight [V, D] (untied only)         -> logits/kernel [D, V]
  model.norm.weight                           -> final_norm/scale
  layers.i.input_layernorm.weight             -> block_i/attn_norm/scale
  layers.i.post_attention_layernorm.weight    -> block_i/mlp_norm/scale
  layers.i.self_attn.{q,k,v}_proj.{weight,bias} -> block_i/attn/qkv [D, 3, H, Dh] (and [3, H, Dh]),
                                                 or, with fewer key/value heads, attn/q
                                                 [D, H, Dh] and attn/kv [D, 2, Hkv, Dh]
  layers.i.self_attn.o_proj.weight            -> block_i/attn/out/kernel [H, Dh, D]
  layers.i.mlp.{gate,up,down}_proj.weight     -> block_i/mlp/{gate,up,down}/kernel

RoPE needs no permutation: Hugging Face's rotate_half pairs x[i] with x[i + Dh/2] at frequency
θ^(-2i/Dh), as md4jax's half-split RoPE does. The attention scale is 1/√Dh in both.

LLaDA's tensors (OLMo's names) are

  model.transformer.wte.weight, .ln_f.weight, .ff_out.weight (untied head)
  model.transformer.blocks.i.{q_proj, k_proj, v_proj, attn_out}.weight (attention)
  model.transformer.blocks.i.{attn_norm, ff_norm}.weight, {ff_proj, up_proj, ff_out}.weight
                                              (gate, up, down of the SwiGLU MLP)

and Dream's as Qwen2's. A released dLLM's mask row (md4jax's input id V) copies the row of its
own mask id (model.checkpoint_mask_id); export writes row V back to it.

For Llama and Qwen2, the mask row is the mean of the V token rows: an input at the centre of
the pretrained embeddings, which the first RMSNorm scales like any token's, so a pretrained
network reads it as a plausible but uninformative token until fine-tuning shapes it. With tied
embeddings the logits read the first V rows only, so it never changes a prediction. Exporting
drops it.
"""

import collections
import dataclasses
from typing import Callable, Optional

import jax
import numpy as np

# Each family's tensor names (`to_md4jax`); {i} is the layer.
_LLAMA_NAMES = {
  "embed": "model.embed_tokens.weight",
  "head": "lm_head.weight",
  "final_norm": "model.norm.weight",
  "layer": "model.layers.{i}.",
  "q": "self_attn.q_proj",
  "k": "self_attn.k_proj",
  "v": "self_attn.v_proj",
  "out": "self_attn.o_proj",
  "attn_norm": "input_layernorm",
  "mlp_norm": "post_attention_layernorm",
  "gate": "mlp.gate_proj",
  "up": "mlp.up_proj",
  "down": "mlp.down_proj",
}
_LLADA_NAMES = {
  "embed": "model.transformer.wte.weight",
  "head": "model.transformer.ff_out.weight",
  "final_norm": "model.transformer.ln_f.weight",
  "layer": "model.transformer.blocks.{i}.",
  "q": "q_proj",
  "k": "k_proj",
  "v": "v_proj",
  "out": "attn_out",
  "attn_norm": "attn_norm",
  "mlp_norm": "ff_norm",
  "gate": "ff_proj",
  "up": "up_proj",
  "down": "ff_out",
}


def tensor_names(model_type: str) -> dict:
  """The family's tensor names: LLaDA's own, or Llama's (Qwen2 and Dream share them)."""
  return _LLADA_NAMES if model_type == "llada" else _LLAMA_NAMES


# Tensors some checkpoints carry that hold no weight (RoPE's frequencies, recomputed here).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _dims(options: dict) -> tuple:
  """(D, H, Hkv, Dh) of md4jax model options."""
  heads = options["num_heads"]
  return (
    options["model_dim"],
    heads,
    options["num_kv_heads"] or heads,
    options["model_dim"] // heads,
  )


def _layers(params: dict, num_layers: int) -> list:
  """Each block's params, whether the blocks are separate or stacked (model.scan_layers)."""
  if "blocks" in params:
    stacked = params["blocks"]["block"]
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(num_layers)]
  return [params[f"block_{i}"] for i in range(num_layers)]


@dataclasses.dataclass(frozen=True)
class Piece:
  """Where one Hugging Face tensor goes in md4jax's params (`layout`)."""

  name: str  # Its name in the safetensors files.
  shape: tuple  # Its shape, as config.json implies it.
  leaf: tuple  # The md4jax param it is (part of), as a path of keys: ("block_0", "attn", ...).
  index: tuple  # Where in that param: a NumPy index (() for all of it).
  convert: Callable = lambda tensor: tensor  # float32 tensor -> the value at index.
  # A tied head: read when the files hold one, and then only checked to equal the embedding
  # rows at leaf[index] (nothing is written).
  check: bool = False


@dataclasses.dataclass(frozen=True)
class Layout:
  """The one mapping of Hugging Face tensors to md4jax params, tensor by tensor."""

  pieces: dict  # {name: Piece}, in the order their errors are reported.
  leaves: dict  # {param path: shape} of every md4jax param.
  # {param path: f(array)} completing a param in place once all its pieces are in (the mask row).
  finish: dict


def layout(
  options: dict, scan_layers: bool = False, vocab_size: int = 0, model_type: str = "llama"
) -> Layout:
  """Where each of model_type's Hugging Face tensors goes in md4jax's params (float32): the module
  docstring's table, tensor by tensor. vocab_size > 0 keeps only the first vocab_size token rows
  (a padded vocabulary cut to its tokenizer's). Raises ValueError for a vocab_size the model
  cannot take."""
  names = tensor_names(model_type)
  width, heads, kv_heads, head_dim = _dims(options)
  full_vocab = options["vocab_size"]
  vocab = vocab_size or full_vocab
  if vocab > full_vocab:
    raise ValueError(f"vocab_size {vocab} is larger than the model's {full_vocab} token rows.")
  mask_id = options["checkpoint_mask_id"]
  if mask_id >= vocab:
    raise ValueError(f"vocab_size {vocab} cuts off the checkpoint's mask id {mask_id}.")
  pieces, leaves, finish = {}, {}, {}

  def add(name, shape, leaf, leaf_shape, index=(), convert=Piece.convert, check=False):
    if leaf in leaves and leaves[leaf] != leaf_shape:
      raise AssertionError(f"{leaf}: {leaves[leaf]} vs {leaf_shape}")
    leaves[leaf] = leaf_shape
    pieces[name] = Piece(name, tuple(shape), leaf, tuple(index), convert, check)

  rows = lambda tensor: tensor[:vocab]
  embedding = ("embed", "embedding")
  add(names["embed"], (full_vocab, width), embedding, (vocab + 1, width), (slice(0, vocab),), rows)

  def mask_row(array):
    if mask_id >= 0:  # The checkpoint's own trained mask embedding.
      array[vocab] = array[mask_id]
    else:  # The mean token row, summed in float64 (rounded once: a re-import gives it again).
      array[vocab] = array[:vocab].mean(axis=0, dtype=np.float64).astype(np.float32)

  finish[embedding] = mask_row
  add(names["final_norm"], (width,), ("final_norm", "scale"), (width,))
  if not options["tie_embeddings"]:
    head = lambda tensor: tensor[:vocab].T
    add(names["head"], (full_vocab, width), ("logits", "kernel"), (width, vocab), (), head)
  else:  # A tied model's files may still hold the head: it must be the embedding.
    add(
      names["head"],
      (full_vocab, width),
      embedding,
      (vocab + 1, width),
      (slice(0, vocab),),
      rows,
      True,
    )

  # Each layer's tensors: (name after the layer's prefix, its shape, the param in md4jax's block,
  # that param's shape, where in it, how). With as many key/value heads as heads q, k and v are
  # one [D, 3, H, Dh] qkv kernel ([3, H, Dh] bias), else q and a [D, 2, Hkv, Dh] kv.
  per_layer = []
  for bias in (False, True) if options["qkv_bias"] else (False,):
    for j, p in enumerate("qkv"):
      n = heads if p == "q" else kv_heads
      if kv_heads == heads:
        param, shape, index = "qkv", (3, heads, head_dim), (j,)
      elif p == "q":
        param, shape, index = "q", (heads, head_dim), ()
      else:
        param, shape, index = "kv", (2, kv_heads, head_dim), (j - 1,)
      if bias:
        as_heads = lambda b, n=n: b.reshape(n, head_dim)
        per_layer.append(
          (f"{names[p]}.bias", (n * head_dim,), param, "bias", shape, index, as_heads)
        )
      else:
        kernel = lambda w, n=n: w.T.reshape(width, n, head_dim)
        index = (slice(None), *index)
        per_layer.append(
          (
            f"{names[p]}.weight",
            (n * head_dim, width),
            param,
            "kernel",
            (width, *shape),
            index,
            kernel,
          )
        )
  out = lambda w: w.T.reshape(heads, head_dim, width)
  per_layer.append(
    (
      f"{names['out']}.weight",
      (width, heads * head_dim),
      "out",
      "kernel",
      (heads, head_dim, width),
      (),
      out,
    )
  )
  per_layer = [
    (name, shape, ("attn", param, kind), *rest) for name, shape, param, kind, *rest in per_layer
  ]
  for norm in ("attn_norm", "mlp_norm"):
    per_layer.append(
      (f"{names[norm]}.weight", (width,), (norm, "scale"), (width,), (), Piece.convert)
    )
  mlp_dim = options["mlp_dim"]
  for name, shape in (
    ("gate", (mlp_dim, width)),
    ("up", (mlp_dim, width)),
    ("down", (width, mlp_dim)),
  ):
    per_layer.append(
      (f"{names[name]}.weight", shape, ("mlp", name, "kernel"), shape[::-1], (), np.transpose)
    )
  num_layers = options["num_layers"]
  for i in range(num_layers):
    for name, shape, path, param_shape, index, convert in per_layer:
      if scan_layers:  # Stacked blocks: layer i is row i of each param.
        leaf, leaf_shape, index = (
          ("blocks", "block", *path),
          (num_layers, *param_shape),
          (i, *index),
        )
      else:
        leaf, leaf_shape = (f"block_{i}", *path), param_shape
      add(names["layer"].format(i=i) + name, shape, leaf, leaf_shape, index, convert)
  return Layout(pieces, leaves, finish)


def check_tensors(plan: Layout, shapes: dict) -> list:
  """The names of the tensors `plan` reads, of the files' {name: shape}; ValueError naming the
  first missing or misshapen one in the plan's order, then any the plan has no place for."""
  shapes = {k: tuple(v) for k, v in shapes.items() if not k.endswith(_IGNORED_SUFFIXES)}
  for name, piece in plan.pieces.items():
    if name not in shapes:
      if piece.check:  # A tied head is optional.
        continue
      raise ValueError(f"The safetensors files have no tensor {name!r}.")
    if shapes[name] != piece.shape:
      raise ValueError(
        f"Tensor {name!r} has shape {list(shapes[name])}, but config.json implies "
        f"{list(piece.shape)}."
      )
  extra = sorted(set(shapes) - set(plan.pieces))
  if extra:
    raise ValueError(f"Unexpected tensors in the safetensors files: {extra[:5]}.")
  return [name for name in plan.pieces if name in shapes]


class Assembler:
  """md4jax params from Hugging Face tensors handed over one at a time, in any order.

  Each param is put together on the host from its pieces (q, k and v into one qkv kernel; each
  layer's into the stacked param under model.scan_layers), then handed to `place(path, array)`
  as soon as it is whole, and its host copy released: besides what `place` keeps, the host holds
  the params still incomplete. `add` takes the tensors of `check_tensors`' list of names.
  """

  def __init__(self, plan: Layout, names, place: Optional[Callable] = None):
    self._plan = plan
    self._place = place or (lambda path, array: array)
    self._due = collections.Counter()  # Pieces each param still waits for.
    self._checks = collections.defaultdict(set)  # Tied heads each param still waits for.
    for name in names:
      piece = plan.pieces[name]
      (self._checks[piece.leaf].add(name) if piece.check else self._due.update([piece.leaf]))
    self._arrays = {}  # Host arrays of params incomplete, or awaiting a check.
    self._early = collections.defaultdict(list)  # (piece, value) of checks before their param.
    self.placed = {}  # {param path: what place returned}

  def add(self, name: str, tensor: np.ndarray):
    piece = self._plan.pieces[name]
    value = piece.convert(np.asarray(tensor, np.float32))
    del tensor
    leaf = piece.leaf
    if piece.check:
      if self._due[leaf]:  # The param is not read yet: checked once it is.
        self._early[leaf].append((piece, value))
      else:
        _check_tied(piece, value, self._arrays[leaf])
      self._checks[leaf].discard(name)
      self._release(leaf)
      return
    if leaf not in self._arrays:
      self._arrays[leaf] = np.empty(self._plan.leaves[leaf], np.float32)
    array = self._arrays[leaf]
    array[piece.index] = value
    del value
    self._due[leaf] -= 1
    if self._due[leaf] == 0:
      if leaf in self._plan.finish:
        self._plan.finish[leaf](array)
      for early, value in self._early.pop(leaf, []):
        _check_tied(early, value, array)
      self.placed[leaf] = self._place(leaf, array)
      self._release(leaf)

  def _release(self, leaf):
    if not self._due[leaf] and not self._checks[leaf]:
      self._arrays.pop(leaf, None)

  def params(self) -> dict:
    """The placed params as md4jax's nested dicts; every param must be whole."""
    missing = sorted(set(self._plan.leaves) - set(self.placed))
    if missing:
      raise ValueError(f"The safetensors files gave no value for {missing[:3]}.")
    params = {}
    for path, value in self.placed.items():
      node = params
      for key in path[:-1]:
        node = node.setdefault(key, {})
      node[path[-1]] = value
    return params


def _check_tied(piece: Piece, value: np.ndarray, array: np.ndarray):
  if not np.array_equal(value, array[piece.index]):
    raise ValueError("tie_word_embeddings is true, but lm_head.weight differs from the embedding.")


def to_md4jax(
  tensors: dict,
  options: dict,
  scan_layers: bool = False,
  vocab_size: int = 0,
  model_type: str = "llama",
) -> dict:
  """md4jax params (float32 numpy) from Hugging Face tensors (numpy, any float dtype) named as
  model_type's safetensors files name them; vocab_size > 0 keeps only the first vocab_size token
  rows (a padded vocabulary cut to its tokenizer's). Raises ValueError naming a missing, extra or
  misshapen one. (`layout` is the mapping; md4jax.app.hf streams a folder through it tensor by
  tensor.)"""
  plan = layout(options, scan_layers, vocab_size, model_type)
  names = check_tensors(plan, {name: np.shape(value) for name, value in tensors.items()})
  assembler = Assembler(plan, names)
  for name in names:
    assembler.add(name, tensors[name])
  return assembler.params()


def from_md4jax(params: dict, options: dict, dtype, model_type: str = "llama") -> dict:
  """Hugging Face tensors {name: numpy array of `dtype`} named as model_type's, from md4jax params
  (numpy): the mask row dropped (or, with a checkpoint mask id, written to that id's row); no
  head with tied embeddings (as save_pretrained writes them)."""
  names = tensor_names(model_type)
  params = jax.tree.map(np.asarray, params)
  width, heads, kv_heads, _ = _dims(options)
  flat = lambda kernel: np.ascontiguousarray(kernel.reshape(width, -1).T)
  embedding = params["embed"]["embedding"]
  tokens = embedding[: embedding.shape[0] - 1]
  if options["checkpoint_mask_id"] >= 0:  # The mask's input is row V: fine-tuning moved it.
    tokens = tokens.copy()
    tokens[options["checkpoint_mask_id"]] = embedding[-1]
  tensors = {names["embed"]: tokens, names["final_norm"]: params["final_norm"]["scale"]}
  if not options["tie_embeddings"]:
    tensors[names["head"]] = params["logits"]["kernel"].T
  for i, block in enumerate(_layers(params, options["num_layers"])):
    prefix = names["layer"].format(i=i)
    attn = block["attn"]
    if kv_heads == heads:
      kernels = [attn["qkv"]["kernel"][:, j] for j in range(3)]
      biases = list(attn["qkv"]["bias"]) if options["qkv_bias"] else None
    else:
      kernels = [attn["q"]["kernel"], attn["kv"]["kernel"][:, 0], attn["kv"]["kernel"][:, 1]]
      biases = [attn["q"]["bias"], *attn["kv"]["bias"]] if options["qkv_bias"] else None
    for j, name in enumerate("qkv"):
      tensors[f"{prefix}{names[name]}.weight"] = flat(kernels[j])
      if biases is not None:
        tensors[f"{prefix}{names[name]}.bias"] = biases[j].reshape(-1)
    tensors[f"{prefix}{names['out']}.weight"] = attn["out"]["kernel"].reshape(-1, width).T
    tensors[f"{prefix}{names['attn_norm']}.weight"] = block["attn_norm"]["scale"]
    tensors[f"{prefix}{names['mlp_norm']}.weight"] = block["mlp_norm"]["scale"]
    for name in ("gate", "up", "down"):
      tensors[f"{prefix}{names[name]}.weight"] = block["mlp"][name]["kernel"].T
  return {name: np.ascontiguousarray(value).astype(dtype) for name, value in tensors.items()}
