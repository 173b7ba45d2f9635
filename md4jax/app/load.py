"""`md4jax.load`: a trained run (a workdir) or a Hugging Face folder as (config, model, params,
tokenizer) and a denoiser ready for `md4jax.sample` and `md4jax.nelbo`.

  loaded = md4jax.load("/tmp/md4jax_default")            # the newest checkpoint's EMA params
  tokens, info = md4jax.sample(key, loaded.denoise_fn, batch_size=4, length=64,
                               schedule=loaded.schedule, mask_id=loaded.mask_id, num_steps=64)

The one way from a path to a model: the judge, the lm-eval model, training.init_from, export
and the workdir modes all come through here (`abstract_state`, `restore`).
"""

import dataclasses
import pathlib
from typing import Any, Callable, Optional

import jax
import ml_collections
import numpy as np
from absl import logging

from md4jax import config as config_lib
from md4jax.app import hf as hf_lib
from md4jax.data import sources
from md4jax.data import tokenizer as tokenizer_lib
from md4jax.diffusion import groundtruth
from md4jax.diffusion.denoiser import Denoiser
from md4jax.model import hf_config
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint, objective
from md4jax.training import state as state_lib

PARAMS = ("ema", "raw")


class LoadError(ValueError):
  """A path md4jax cannot load: one line naming the path and what is missing."""


class MarkovCodec:
  """The generated Markov language's text: its ids separated by spaces ("3 17 5")."""

  eos_id = None

  def __init__(self, config: ml_collections.ConfigDict):
    self._source = sources.MarkovSource(config)

  def encode(self, text: str) -> np.ndarray:
    return self._source.encode(text)

  def decode(self, ids) -> str:
    return self._source.decode(np.asarray(ids))


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A model ready to sample and score (a test may build one around the exact oracle)."""

  config: ml_collections.ConfigDict
  model: Any  # A Transformer, or anything with its apply(variables, z, time, segments, positions).
  params: Any  # The network's params (and a learned schedule's θ).
  tokenizer: Any  # encode(text) -> ids, decode(ids) -> text, eos_id (None: documents have no end).
  mesh: jax.sharding.Mesh
  step: Optional[int] = None  # The checkpoint's step (None: a Hugging Face folder).
  path: Optional[pathlib.Path] = None

  @property
  def mask_id(self) -> Optional[int]:
    """V, one past the vocabulary; None for a uniform-state model, which has no mask."""
    return None if self.process == "uniform" else self.config.data.vocab_size

  @property
  def process(self) -> str:
    """config.diffusion.process: "masked", or "uniform" (sample and nelbo take it as process=)."""
    return self.config.diffusion.process

  @property
  def schedule(self):
    """The masking schedule (a learned one read from the params)."""
    return objective.schedule_of(self.params, self.config)

  @property
  def denoise_fn(self) -> Denoiser:
    """The model as `md4jax.sample` and `md4jax.nelbo` call it, its params as pytree leaves."""
    return objective.sampling_denoiser(self.model, self.params, self.config)

  @property
  def language(self) -> Optional[groundtruth.MarkovLanguage]:
    """The generated language a workdir trained on (data.dataset 'markov'), else None."""
    data = self.config.data
    if data.dataset != "markov" or self.step is None:  # A Hugging Face folder's data is text.
      return None
    return groundtruth.MarkovLanguage(
      data.vocab_size, seed=data.language_seed, concentration=data.concentration
    )


def abstract_state(config: ml_collections.ConfigDict, mesh):
  """(model, optimizer, the train state's shapes and shardings on mesh) of config."""
  model, optimizer = state_lib.build_model(config), state_lib.make_optimizer(config)
  return model, optimizer, state_lib.abstract_state(config, model, optimizer, mesh)


def restore(workdir, abstract, where: str, step: Optional[int] = None, log: Callable = print):
  """The newest readable checkpoint of workdir (or the one of `step`), onto the shardings of
  abstract; CheckpointError in one line starting with `where` (e.g. "eval.judge_workdir='/w'")
  when there is none. Never creates the workdir's checkpoints/."""
  workdir = workdir_lib.as_workdir(workdir)
  if not workdir.checkpoints.is_dir():
    raise checkpoint.CheckpointError(f"{where}: no checkpoint in {workdir.checkpoints}.")
  manager = checkpoint.make_manager(workdir.checkpoints, 1)
  if step is not None:
    return checkpoint.restore_step(manager, step, abstract, where)
  restored = checkpoint.restore(manager, abstract, log)
  if restored is None:
    raise checkpoint.CheckpointError(f"{where}: no checkpoint in {workdir.checkpoints}.")
  return restored


def _tokenizer(config: ml_collections.ConfigDict, workdir: workdir_lib.Workdir):
  if config.data.dataset == "markov":
    return MarkovCodec(config)
  if workdir.tokenizer.is_file() or not config.data.tokenizer_path:
    return tokenizer_lib.load(workdir.tokenizer)  # Saved by training (or md4jax.convert).
  return tokenizer_lib.load(config.data.tokenizer_path)  # A workdir that has not trained yet.


def override(config: ml_collections.ConfigDict, name: str, value, where: str = ""):
  """Sets the dotted key `name` of config; LoadError (starting with `where`) if the config has no
  such key or it takes another type."""
  role = f"{where}: " if where else ""
  *sections, key = name.split(".")
  node = config
  for section in sections:
    if section not in node or not isinstance(node[section], ml_collections.ConfigDict):
      raise LoadError(f"{role}config.{name}: the config has no section {section!r}.")
    node = node[section]
  if key not in node or isinstance(node[key], ml_collections.ConfigDict):
    raise LoadError(f"{role}config.{name}: the config has no key {key!r} there.")
  try:
    node[key] = value
  except TypeError:
    raise LoadError(
      f"{role}config.{name}={value!r}: a {type(node[key]).__name__} is expected, like "
      f"{node[key]!r}."
    ) from None


def load(
  path,
  *,
  step: Optional[int] = None,
  params: str = "ema",
  overrides: Optional[dict] = None,
  mesh=None,
  model_type: Optional[str] = None,
  role: Optional[str] = None,
  check_config: bool = True,
  log: Callable = logging.warning,
) -> Loaded:
  """The model at `path` (the module docstring).

  Args:
    path: an md4jax workdir (its config.json and checkpoints/) or a Hugging Face Llama or
      Qwen2 folder (config.json, *.safetensors, tokenizer.json), as `python -m md4jax.convert`
      reads it.
    step: a workdir's checkpoint of this step (default: the newest that reads back).
    params: "ema" (default) or "raw": which of a checkpoint's params.
    overrides: {dotted config key: value} set before the config is validated (evaluation and
      sampling keys, e.g. {"sample.num_steps": 32}).
    mesh: the devices the params are placed on (default: a mesh of every device, as the config's
      mesh keys lay it out).
    model_type: a Hugging Face folder's model.type, "ar" (causal) or "mdm"; default the folder's
      own (mdm for LLaDA and Dream, ar for Llama and Qwen2).
    role: the setting that named the path, for error messages (default "path"), e.g.
      "eval.judge_workdir": "eval.judge_workdir='/w': no checkpoint in /w/checkpoints."
    check_config: validate the config on mesh, as a run of it would; False for a caller that
      takes only the params (a judge, training.init_from).

  Raises LoadError (a ValueError) in one line naming the path and what is missing: a path that
  does not exist, holds no config.json or one that does not read, or a folder of a model type
  md4jax does not read; and CheckpointError (one line too) for a workdir without a readable
  checkpoint (of `step`).
  """
  role = role or "path"
  where = f"{role}={str(path)!r}"  # What errors name.
  folder = pathlib.Path(path)
  if params not in PARAMS:
    raise LoadError(f"load: params={params!r} is unknown; valid: {', '.join(PARAMS)}.")
  try:
    is_hf = hf_lib.is_hf_folder(folder)
    if is_hf:
      if step is not None or params != "ema":
        raise LoadError(
          f"{where}: a Hugging Face folder holds one set of weights: no step or params."
        )
      config, hf = hf_lib.folder_config(folder, model_type=model_type)
      # Its context: the rows the harness and the samplers' windows take.
      if hf_config.context_length(hf):
        config.data.seq_len = hf_config.context_length(hf)
    else:
      config = config_lib.workdir_config(folder, role)
    for name, value in (overrides or {}).items():
      override(config, name, value, where)
    config = config_lib.expand_preset(config)
    mesh = mesh if mesh is not None else sharding.make_mesh(config)
    if check_config:
      config_lib.validate_config(config, mesh.devices.size, mesh.devices.flat[0].platform)
  except LoadError:
    raise
  except (ValueError, FileNotFoundError) as e:
    message = str(e) if str(e).startswith(where) else f"{where}: {e}"
    raise LoadError(" ".join(message.split())) from None
  if is_hf:
    try:
      # Each param placed on mesh as it is read, sharded by config's rules as a run lays it out:
      # never the whole float32 model on every device (32 GB a device for LLaDA-8B).
      placed = hf_lib.folder_params(folder, config, hf, mesh=mesh)
    except (ValueError, FileNotFoundError) as e:
      raise LoadError(" ".join(f"{where}: {e}".split())) from None
    model = state_lib.build_model(config)
    tokenizer = (
      tokenizer_lib.load(config.data.tokenizer_path) if config.data.tokenizer_path else None
    )
    return Loaded(config, model, placed, tokenizer, mesh, None, folder)
  model, _, abstract = abstract_state(config, mesh)
  restored = restore(folder, abstract, where, step, log)
  chosen = restored.state.ema_params if params == "ema" else restored.state.params
  workdir = workdir_lib.as_workdir(folder)
  return Loaded(config, model, chosen, _tokenizer(config, workdir), mesh, restored.step, folder)
