"""Hugging Face Llama and Qwen2 weights <-> md4jax `Transformer` params, and their configs.

Both architectures are md4jax's network in causal mode: pre-norm blocks of RMSNorm
(x / √(mean x² + eps) · weight, Flax's RMSNorm scale), grouped-query attention with RoPE,
and a SwiGLU MLP (down(silu(gate x) · up x)). `model_options` reads config.json into md4jax's
model keys; `to_md4jax` and `from_md4jax` move the tensors (torch's Linear weights are
[out, in], md4jax's kernels [in, out] with the heads split out). `layout` says where each tensor
goes, tensor by tensor: `to_md4jax` (everything in memory) and md4jax.app.hf's streamed import
(one tensor at a time, through `Assembler`) both follow it:

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

LLaDA (model_type "llada", OLMo's names) and Dream ("Dream", Qwen2's names) are released
masked diffusion LMs: the same network, bidirectional. LLaDA's tensors are named

  model.transformer.wte.weight, .ln_f.weight, .ff_out.weight (untied head)
  model.transformer.blocks.i.{q_proj, k_proj, v_proj, attn_out}.weight (attention)
  model.transformer.blocks.i.{attn_norm, ff_norm}.weight, {ff_proj, up_proj, ff_out}.weight
                                              (gate, up, down of the SwiGLU MLP)

and Dream's as Qwen2's. Each has its own mask id inside the vocabulary (config.json's
mask_token_id): md4jax's mask input V copies that row, and the network never predicts that id
(model.checkpoint_mask_id); export writes row V back to it. Dream's logits are shifted: position
i's come from the output at position i − 1 (model.shift_logits).

For Llama and Qwen2, the mask row (md4jax's input id V) is the mean of the V token rows: an input at the centre of
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

ARCHITECTURES = {
  "llama": "LlamaForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "llada": "LLaDAModelLM",
  "Dream": "DreamModel",
}
# The released masked diffusion LMs: bidirectional, with a mask id of their own.
DIFFUSION_TYPES = ("llada", "Dream")
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


# Fields Hugging Face fills in when config.json leaves them out (its configs' defaults).
_HF_DEFAULTS = {
  "hidden_act": "silu",
  "rms_norm_eps": 1e-6,
  "rope_theta": 10000.0,
  "tie_word_embeddings": False,
  "attention_bias": False,
  "mlp_bias": False,
  "use_sliding_window": False,
}
_REQUIRED = (
  "hidden_size",
  "intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
  "vocab_size",
)
# Tensors some checkpoints carry that hold no weight (RoPE's frequencies, recomputed here).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _field(hf: dict, name: str):
  """config.json's value of `name`, or Hugging Face's default when the file leaves it out."""
  return hf[name] if name in hf else _HF_DEFAULTS[name]


def _rope_theta(hf: dict) -> float:
  """θ of plain RoPE, from transformers 5's rope_parameters or 4's rope_theta / rope_scaling.

  (hf.get: Hugging Face writes an absent and a null field alike, e.g. "rope_scaling": null.)
  """
  rope = hf["rope_parameters"] if hf.get("rope_parameters") else {}
  scaling = hf["rope_scaling"] if hf.get("rope_scaling") else {}
  for spec in (rope, scaling):
    kind = spec["rope_type"] if "rope_type" in spec else spec["type"] if "type" in spec else None
    if kind not in (None, "default"):
      raise ValueError(
        f"config.json: RoPE type {kind!r} is not supported; md4jax's RoPE is the plain one "
        "(rope_type 'default')."
      )
  return float(rope["rope_theta"] if "rope_theta" in rope else _field(hf, "rope_theta"))


# LLaDA's config.json fields (OLMo's) whose other values md4jax's network lacks: {name: the value
# LLaDA-8B has, which md4jax's network is}; an absent field is OLMo's default, listed second.
_LLADA_FIXED = {
  "block_type": ("llama", "sequential"),
  "layer_norm_type": ("rms", "default"),
  "activation_type": ("silu", "swiglu"),
  "rope": (True, False),
  "alibi": (False, False),
  "include_bias": (False, True),
  "include_qkv_bias": (False, False),
  "attention_layer_norm": (False, False),
  "input_emb_norm": (False, False),
  "scale_logits": (False, False),
  "block_group_size": (1, 1),
  "clip_qkv": (None, None),  # OLMo clamps q, k and v to ±clip_qkv: md4jax does not.
  "multi_query_attention": (False, False),  # (null: n_kv_heads says how many heads.)
}
_LLADA_REQUIRED = ("d_model", "n_heads", "n_layers", "mlp_hidden_size", "vocab_size")


def _mask_token_id(hf: dict, rows: int) -> int:
  """A released dLLM's mask id (config.json's mask_token_id), checked to lie in its vocabulary."""
  mask_id = hf["mask_token_id"] if "mask_token_id" in hf else None
  if type(mask_id) is not int or not 0 <= mask_id < rows:  # pylint: disable=unidiomatic-typecheck
    raise ValueError(
      f"config.json ({hf['model_type']}): mask_token_id {mask_id!r} is not an id of its "
      f"{rows}-token vocabulary."
    )
  return mask_id


def _llada_options(hf: dict) -> dict:
  missing = [name for name in _LLADA_REQUIRED if name not in hf]
  if missing:
    raise ValueError(f"config.json (llada) has no {', '.join(missing)}.")
  for name, (wanted, default) in _LLADA_FIXED.items():
    value = hf[name] if name in hf and hf[name] is not None else default
    if value != wanted:
      raise ValueError(
        f"config.json: {name}={value!r} is not supported (md4jax reads LLaDA's Llama-like "
        f"blocks: {name}={wanted!r})."
      )
  width, heads = hf["d_model"], hf["n_heads"]
  kv_heads = hf["n_kv_heads"] if hf.get("n_kv_heads") else heads  # (null: as many as heads)
  if heads % kv_heads or width % heads:
    raise ValueError(
      f"config.json: n_kv_heads={kv_heads} must divide n_heads={heads}, which divides "
      f"d_model={width}."
    )
  rows = hf["embedding_size"] if hf.get("embedding_size") else hf["vocab_size"]
  return {
    "num_layers": hf["n_layers"],
    "model_dim": width,
    "num_heads": heads,
    "num_kv_heads": 0 if kv_heads == heads else kv_heads,
    "mlp_dim": hf["mlp_hidden_size"],
    "norm_eps": float(hf["rms_norm_eps"] if "rms_norm_eps" in hf else 1e-5),
    "rope_base": float(hf["rope_theta"] if "rope_theta" in hf else 10000.0),
    "qkv_bias": False,
    "tie_embeddings": bool(hf["weight_tying"] if "weight_tying" in hf else False),
    "checkpoint_mask_id": _mask_token_id(hf, rows),
    "shift_logits": False,
    "vocab_size": rows,
  }


def model_options(hf: dict) -> dict:
  """md4jax's model keys (and data.vocab_size as "vocab_size") for a Hugging Face config.json.

  Raises ValueError naming the field for an architecture or option md4jax's network lacks.
  """
  model_type = hf["model_type"] if "model_type" in hf else None
  if model_type not in ARCHITECTURES:
    raise ValueError(
      f"config.json: model_type {model_type!r} is not supported; md4jax converts "
      f"{', '.join(ARCHITECTURES)}."
    )
  if model_type == "llada":
    return _llada_options(hf)
  missing = [name for name in _REQUIRED if name not in hf]
  if missing:
    raise ValueError(f"config.json ({model_type}) has no {', '.join(missing)}.")
  width, heads = hf["hidden_size"], hf["num_attention_heads"]
  kv_heads = hf["num_key_value_heads"] if hf.get("num_key_value_heads") else heads
  head_dim = hf["head_dim"] if hf.get("head_dim") else width // heads
  biased = model_type in ("qwen2", "Dream")
  checks = {  # name: (its value, whether md4jax's network lacks it)
    "hidden_act": (_field(hf, "hidden_act"), _field(hf, "hidden_act") != "silu"),
    "head_dim": (head_dim, head_dim * heads != width),
    "num_key_value_heads": (kv_heads, heads % kv_heads != 0),
    "attention_bias": (
      _field(hf, "attention_bias"),
      model_type == "llama" and _field(hf, "attention_bias"),
    ),
    "mlp_bias": (_field(hf, "mlp_bias"), _field(hf, "mlp_bias")),
    "use_sliding_window": (_field(hf, "use_sliding_window"), _field(hf, "use_sliding_window")),
  }
  for name, (value, unsupported) in checks.items():
    if unsupported:
      raise ValueError(
        f"config.json: {name}={value!r} is not supported (md4jax's network: a silu MLP "
        "without biases, head_dim = hidden_size / num_attention_heads dividing into key/value "
        "groups, q/k/v biases only as Qwen2's, full attention)."
      )
  dream = model_type == "Dream"
  return {
    "num_layers": hf["num_hidden_layers"],
    "model_dim": width,
    "num_heads": heads,
    "num_kv_heads": 0 if kv_heads == heads else kv_heads,
    "mlp_dim": hf["intermediate_size"],
    "norm_eps": float(_field(hf, "rms_norm_eps")),
    "rope_base": _rope_theta(hf),
    "qkv_bias": biased,
    "tie_embeddings": bool(_field(hf, "tie_word_embeddings")),
    "checkpoint_mask_id": _mask_token_id(hf, hf["vocab_size"]) if dream else -1,
    "shift_logits": dream,
    "vocab_size": hf["vocab_size"],
  }


def context_length(hf: dict) -> int:
  """The positions a folder's model was trained on (config.json's max_position_embeddings, LLaDA's
  max_sequence_length), 0 when it does not say."""
  for name in ("max_position_embeddings", "max_sequence_length"):
    if hf.get(name):
      return int(hf[name])
  return 0


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


def hf_config(options: dict, dtype_name: str, max_positions: int, base: dict = None) -> dict:
  """A Hugging Face config.json for md4jax model options: `base` (the config.json a workdir was
  converted from) with its architecture fields set, or a fresh one (Qwen2 when the model has q/k/v
  biases, else Llama) whose context is max_positions."""
  config = dict(base) if base else {"max_position_embeddings": max_positions}
  model_type = config["model_type"] if base else "qwen2" if options["qkv_bias"] else "llama"
  if options["qkv_bias"] != (model_type in ("qwen2", "Dream")):
    raise ValueError(
      f"A {model_type} model {'has no' if options['qkv_bias'] else 'has'} q/k/v biases: this "
      f"one has model.qkv_bias={options['qkv_bias']}."
    )
  if (options["checkpoint_mask_id"] >= 0) != (model_type in DIFFUSION_TYPES):
    raise ValueError(
      f"A {model_type} checkpoint {'has a' if model_type in DIFFUSION_TYPES else 'has no'} mask "
      f"id of its own: this model has model.checkpoint_mask_id={options['checkpoint_mask_id']}."
    )
  if options["shift_logits"] != (model_type == "Dream"):
    raise ValueError(
      f"Only Dream's logits are shifted: this {model_type} model has model.shift_logits="
      f"{options['shift_logits']}."
    )
  heads = options["num_heads"]
  if model_type == "llada":
    config.update(
      d_model=options["model_dim"],
      n_heads=heads,
      n_kv_heads=options["num_kv_heads"] or heads,
      n_layers=options["num_layers"],
      mlp_hidden_size=options["mlp_dim"],
      vocab_size=options["vocab_size"],
      embedding_size=options["vocab_size"],
      rms_norm_eps=options["norm_eps"],
      rope_theta=options["rope_base"],
      weight_tying=options["tie_embeddings"],
      mask_token_id=options["checkpoint_mask_id"],
    )
  else:
    config.update(
      architectures=[ARCHITECTURES[model_type]],
      model_type=model_type,
      hidden_size=options["model_dim"],
      intermediate_size=options["mlp_dim"],
      num_hidden_layers=options["num_layers"],
      num_attention_heads=heads,
      num_key_value_heads=options["num_kv_heads"] or heads,
      head_dim=options["model_dim"] // heads,
      vocab_size=options["vocab_size"],
      rms_norm_eps=options["norm_eps"],
      tie_word_embeddings=options["tie_embeddings"],
      hidden_act="silu",
    )
    if model_type == "Dream":
      config["mask_token_id"] = options["checkpoint_mask_id"]
    if config.get("rope_parameters"):  # transformers 5's form; 4's reads rope_theta.
      config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": options["rope_base"]}
    else:
      config.update(rope_theta=options["rope_base"], rope_scaling=None)
  config["dtype" if "dtype" in config else "torch_dtype"] = dtype_name
  return config
