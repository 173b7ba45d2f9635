"""A Hugging Face Llama, Qwen2, LLaDA or Dream folder as an md4jax model, in memory: its config
(md4jax's keys) and its params. `md4jax.load` opens such a folder with it; `python -m md4jax.convert` writes
the workdir of one, and a workdir back as one."""

import json
import pathlib
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from md4jax import config as config_lib
from md4jax.data import chat
from md4jax.data import tokenizer as tokenizer_lib
from md4jax.model import hf_config, hf_folder, hf_tensors
from md4jax.runtime import sharding
from md4jax.training import state as state_lib

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # Its chat template (data.chat_template).
# The mask tokens of the released dLLMs' tokenizers: LLaDA's, Dream's.
MASK_TOKENS = ("<|mdm_mask|>", "<|mask|>")


def is_hf_folder(path) -> bool:
  """Whether path holds a Hugging Face config.json (a "model_type", no md4jax "model" section)."""
  config_json = pathlib.Path(path) / hf_folder.CONFIG_FILE
  if not config_json.is_file():
    return False
  saved = hf_folder.read_config(path)
  return "model_type" in saved and "model" not in saved


def converted_config(
  base: ml_collections.ConfigDict, options: dict, model_type: str, vocab_size: int = 0
) -> ml_collections.ConfigDict:
  """`base` with the model keys (and data.vocab_size) of a converted model of `options`."""
  config = base.copy_and_resolve_references()
  model = config.model
  model.type, model.preset, model.time_conditioning = model_type, "none", "none"
  model.norm, model.mlp, model.embed_dim, model.biases = "rms", "swiglu", 0, False
  for key, value in options.items():
    if key != "vocab_size":
      model[key] = value
  config.data.vocab_size = vocab_size or options["vocab_size"]
  return config


def _model_params(config: ml_collections.ConfigDict):
  """The model's params, abstract and boxed with their logical axis names."""
  model = state_lib.build_model(config)
  tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
  return jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens, jnp.ones((1,)))["params"]


def _by_path(tree) -> dict:
  """{path as a tuple of keys: leaf} of a nested-dict pytree."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(str(getattr(key, "key", key)) for key in path): leaf for path, leaf in flat}


def _check_shapes(expected: dict, got: dict):
  """ValueError naming the params (path: shape dicts) whose names or shapes differ."""
  if expected != got:
    name = lambda path: "".join(f"[{key!r}]" for key in path)  # As jax.tree_util.keystr.
    wrong = [name(k) for k in set(expected) ^ set(got)]
    wrong += [name(k) for k in set(expected) & set(got) if expected[k] != got[k]]
    raise ValueError(f"The converted params do not fit the model at {sorted(wrong)[:5]}.")


def check_fits(config: ml_collections.ConfigDict, params: dict):
  """Raises ValueError unless params have exactly the model's param names and shapes."""
  expected = {path: a.shape for path, a in _by_path(nn.meta.unbox(_model_params(config))).items()}
  _check_shapes(expected, {path: np.shape(a) for path, a in _by_path(params).items()})


def _check_mask_token(source, hf: dict, tokenizer):
  """A released dLLM's tokenizer names its mask token (MASK_TOKENS) at config.json's
  mask_token_id: a ValueError naming both otherwise."""
  for name in MASK_TOKENS:
    token_id = tokenizer.token_to_id(name)
    if token_id is not None:
      if token_id != hf["mask_token_id"]:
        raise ValueError(
          f"{source}: config.json's mask_token_id is {hf['mask_token_id']}, but its tokenizer "
          f"has {name} at id {token_id}."
        )
      return
  raise ValueError(
    f"{source}: its tokenizer.json has no mask token ({', '.join(MASK_TOKENS)}) to check "
    f"mask_token_id={hf['mask_token_id']} against."
  )


def folder_model_type(hf: dict, model_type: Optional[str]) -> str:
  """md4jax's model.type of a folder: "mdm" for a released dLLM, else `model_type` (default ar)."""
  if hf["model_type"] in hf_config.DIFFUSION_TYPES:
    if model_type not in (None, "mdm"):
      raise ValueError(
        f"A {hf['model_type']} folder holds a masked diffusion model: model_type must be 'mdm', "
        f"not {model_type!r}."
      )
    return "mdm"
  return model_type or "ar"


def folder_config(source, base=None, model_type: Optional[str] = None, vocab_size: int = 0):
  """(config, config.json's fields) of the folder `source`: every key the model does not fix
  from `base` (base_config without one); model.type `model_type` ("ar" or "mdm"; default: the
  folder's, mdm for LLaDA and Dream, else ar). With a tokenizer.json there, the config reads it
  (data.tokenizer 'bpe'), and text data needs its size to be the model's rows. A LLaDA or Dream
  folder needs its tokenizer, whose mask token must be config.json's mask_token_id."""
  hf = hf_folder.read_config(source)
  options = hf_config.model_options(hf)
  model_type = folder_model_type(hf, model_type)
  config = converted_config(base or config_lib.base_config(), options, model_type, vocab_size)
  hf_tokenizer = pathlib.Path(source) / hf_folder.TOKENIZER_FILE
  if hf["model_type"] in hf_config.DIFFUSION_TYPES:
    if not hf_tokenizer.is_file():
      raise ValueError(
        f"{source} has no {hf_folder.TOKENIZER_FILE}: a {hf['model_type']} folder needs its "
        "tokenizer (its mask token and chat template)."
      )
    _check_mask_token(source, hf, tokenizer_lib.load(hf_tokenizer).tokenizer)
  tokenizer_config = pathlib.Path(source) / TOKENIZER_CONFIG_FILE
  if tokenizer_config.is_file():
    try:
      config.data.chat_template = chat.template_of(json.loads(tokenizer_config.read_text("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:
      raise ValueError(f"{tokenizer_config} does not read as a tokenizer config ({e!r}).") from None
  if hf_tokenizer.is_file():
    config.data.tokenizer = "bpe"
    config.data.tokenizer_path = str(hf_tokenizer.absolute())
    size = tokenizer_lib.load(hf_tokenizer).vocab_size
    if config.data.dataset != "markov" and size != config.data.vocab_size:
      raise ValueError(
        f"{hf_tokenizer} has {size} ids but the model {config.data.vocab_size} token rows; text "
        f"data needs them equal (the mask id is one past the last): pass --vocab_size={size} "
        "if the rows past it are padding."
      )
  return config, hf


def folder_params(
  source, config: ml_collections.ConfigDict, hf: dict, vocab_size: int = 0, mesh=None
):
  """The params of the folder's weights for config (`folder_config`'s), read tensor by tensor
  (hf_tensors.layout, the one mapping): NumPy arrays, or with `mesh` jax arrays placed as they
  load, each sharded over mesh by md4jax's logical axis rules, as a run of config lays them out.
  The host holds one tensor at a time and the params not yet whole (all of the stacked blocks'
  under model.scan_layers); every name and shape is checked, from the files' headers, before any
  weight is read."""
  headers = hf_folder.tensor_headers(source)
  options = hf_config.model_options(hf)
  plan = hf_tensors.layout(options, config.model.scan_layers, vocab_size, hf["model_type"])
  names = hf_tensors.check_tensors(plan, {name: header.shape for name, header in headers.items()})
  abstract = _model_params(config)
  unboxed = _by_path(nn.meta.unbox(abstract))
  _check_shapes(
    {path: leaf.shape for path, leaf in unboxed.items()},
    {path: tuple(shape) for path, shape in plan.leaves.items()},
  )
  place = None
  if mesh is not None:
    shardings = _by_path(sharding.logical_shardings(abstract, mesh))

    def place(path, array):
      array = array.astype(unboxed[path].dtype, copy=False)
      return jax.make_array_from_callback(array.shape, shardings[path], lambda index: array[index])

  assembler = hf_tensors.Assembler(plan, names, place)
  read = set(names)
  for name, tensor in hf_folder.stream_tensors({n: h for n, h in headers.items() if n in read}):
    assembler.add(name, tensor)
    del tensor  # Released before the next is read.
  return assembler.params()


def md4jax_options(config: ml_collections.ConfigDict) -> dict:
  """hf_config's model options of a workdir's config; ValueError naming a key no Hugging Face
  Llama or Qwen2 has an equivalent of."""
  model = config.model
  for key, wanted in (
    ("norm", "rms"),
    ("mlp", "swiglu"),
    ("time_conditioning", "none"),
    ("embed_dim", 0),
  ):
    if model[key] != wanted:
      raise ValueError(
        f"model.{key}={model[key]!r}: Llama and Qwen2 have no equivalent; export needs {wanted!r}."
      )
  keys = ("num_layers", "model_dim", "num_heads", "num_kv_heads", "mlp_dim", "norm_eps")
  keys += ("rope_base", "qkv_bias", "tie_embeddings", "checkpoint_mask_id", "shift_logits")
  return {**{key: model[key] for key in keys}, "vocab_size": config.data.vocab_size}
