"""Hugging Face config.json <-> md4jax model options, for Llama, Qwen2, LLaDA and Dream.

Llama and Qwen2 are md4jax's network in causal mode: pre-norm blocks of RMSNorm
(x / √(mean x² + eps) · weight, Flax's RMSNorm scale), grouped-query attention with RoPE,
and a SwiGLU MLP (down(silu(gate x) · up x)). `model_options` reads config.json into md4jax's
model keys, raising for an option the network lacks; `hf_config` writes a config.json for md4jax
model options. (md4jax.model.hf_tensors moves the weights.)

LLaDA (model_type "llada", OLMo's names) and Dream ("Dream", Qwen2's names) are released
masked diffusion LMs: the same network, bidirectional. Each has its own mask id inside the
vocabulary (config.json's mask_token_id): md4jax's mask input V copies that row, and the network
never predicts that id (model.checkpoint_mask_id); export writes row V back to it. Dream's logits
are shifted: position i's come from the output at position i − 1 (model.shift_logits).
"""

ARCHITECTURES = {
  "llama": "LlamaForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "llada": "LLaDAModelLM",
  "Dream": "DreamModel",
}
# The released masked diffusion LMs: bidirectional, with a mask id of their own.
DIFFUSION_TYPES = ("llada", "Dream")

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
