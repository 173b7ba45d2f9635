r"""Converts Hugging Face Llama, Qwen2, LLaDA and Dream models into md4jax workdirs, and back.

  python -m md4jax.convert --in=HF_FOLDER --out=/tmp/qwen [--model_type=ar|mdm] \
      [--config=configs/localtext.py --config.data.path=corpus.txt ...]
  python -m md4jax.main --config=configs/workdir.py:/tmp/qwen --workdir=/tmp/qwen --mode=sample
  python -m md4jax.convert --direction=export --in=/tmp/qwen --out=/tmp/qwen_hf

Import reads HF_FOLDER's config.json and *.safetensors (and tokenizer.json, copied into the
workdir with data.tokenizer = "bpe"; its other files, such as tokenizer_config.json's chat template
and a released dLLM's modeling code, are kept in the workdir's hf_files/ for export) and writes the workdir a run of md4jax.main continues: its
config.json and a step-0 checkpoint (the converted weights as params and EMA, a fresh optimizer
state; read tensor by tensor and written as the params alone, which whatever restores it
completes: docs/convert.md, Memory). Every key the model does not fix comes from --config
(base_config without one). Export writes the EMA params (--params=raw: the raw ones) of a
workdir's newest checkpoint as config.json and model.safetensors. What maps to what, the mask
row and the limits: docs/convert.md.
"""

import functools
import json
import pathlib
import shutil
import types
from typing import Optional

import jax
import numpy as np
from absl import app, flags, logging
from jax.sharding import Mesh
from ml_collections import config_flags

from md4jax import config as config_lib
from md4jax import user_errors
from md4jax.app import hf as hf_lib
from md4jax.app import load
from md4jax.data import tokenizer as tokenizer_lib
from md4jax.model import hf_config, hf_folder, hf_tensors, lora
from md4jax.runtime import sharding
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint, objective
from md4jax.training import state as state_lib


def _define_flags() -> types.SimpleNamespace:
  """The command line's flags, defined only when this module runs as the program: md4jax.main and
  md4jax.aot define --config too, and the tests import them all in one process."""
  cli = types.SimpleNamespace()
  cli.source = flags.DEFINE_string(
    "in", None, "import: a Hugging Face model folder; export: a workdir."
  )
  cli.out = flags.DEFINE_string(
    "out", None, "import: the new workdir; export: the folder to write."
  )
  cli.direction = flags.DEFINE_enum(
    "direction", "import", ["import", "export"], "import (Hugging Face -> md4jax) or export."
  )
  cli.model_type = flags.DEFINE_enum(
    "model_type",
    None,
    ["ar", "mdm"],
    "import: model.type of the workdir, 'ar' (causal) or 'mdm' (bidirectional); default the "
    "folder's own: mdm for LLaDA and Dream, ar for Llama and Qwen2.",
  )
  cli.config = config_flags.DEFINE_config_file(
    "config", None, "import: a config file whose other keys the workdir takes.", lock_config=True
  )
  cli.vocab_size = flags.DEFINE_integer(
    "vocab_size",
    0,
    "import: keep only the first vocab_size token rows (a vocabulary padded past its tokenizer's "
    "size, as Qwen2's); 0 keeps them all.",
  )
  cli.dtype = flags.DEFINE_enum(
    "dtype",
    None,
    list(hf_folder.DTYPES),
    "export: the weights' dtype; default the imported model's, else float32.",
  )
  cli.params = flags.DEFINE_enum(
    "params", "ema", ["ema", "raw"], "export: the EMA or the raw params."
  )
  return cli


USER_ERRORS = (
  ValueError,
  FileNotFoundError,
  workdir_lib.WorkdirError,
  checkpoint.CheckpointError,
)
# The state of every training iterator before its first batch (sources.BatchIterator's,
# pipeline.TrainIterator's): the converted run reads its data from the start.
_FRESH_DATA_STATE = {"next_batch_index": 0}
# The original config.json beside a converted workdir's: export keeps its other fields.
HF_CONFIG_FILE = "hf_config.json"
# The folder's other small files (tokenizer_config.json, generation_config.json, a dLLM's
# modeling code), kept for export: neither weights, nor what export writes itself.
HF_FILES = "hf_files"
_KEPT_SUFFIXES = (".json", ".py", ".jinja", ".txt", ".model")
_NOT_KEPT = (hf_folder.CONFIG_FILE, hf_folder.TOKENIZER_FILE, hf_folder.INDEX_FILE)


def _cpu():
  """The host's first CPU device: whole models are converted in host memory."""
  return jax.local_devices(backend="cpu")[0]


def _kept_files(source) -> list:
  """The folder's files that export writes back as they were (HF_FILES)."""
  return sorted(
    path
    for path in pathlib.Path(source).iterdir()
    if path.is_file() and path.suffix in _KEPT_SUFFIXES and path.name not in _NOT_KEPT
  )


def import_hf(source, workdir, config=None, model_type=None, vocab_size: int = 0):
  """Writes the md4jax workdir of the Hugging Face folder `source`; returns its config.

  The weights stream in tensor by tensor (hf_lib.folder_params), each param placed on config's
  mesh as soon as it is whole, and the step-0 checkpoint holds the params alone
  (checkpoint.save_start): the host holds about the params once, never their EMA or Adam's
  moments, which the run that resumes it makes on its own devices."""
  workdir = workdir_lib.as_workdir(workdir)
  if workdir.checkpoints.is_dir() and any(workdir.checkpoints.iterdir()):
    raise ValueError(f"{workdir.checkpoints} already holds checkpoints: convert into a new --out.")
  config, hf = hf_lib.folder_config(source, config, model_type, vocab_size)
  hf_tokenizer = pathlib.Path(source) / hf_folder.TOKENIZER_FILE
  if hf_tokenizer.is_file():  # The workdir keeps its own copy.
    config.data.tokenizer_path = str(workdir.tokenizer.absolute())
  config_lib.validate_config(config, jax.device_count(), jax.devices()[0].platform)
  mesh = sharding.make_mesh(config)
  params = hf_lib.folder_params(source, config, hf, vocab_size, mesh)
  start = _start(config, params, mesh)
  with workdir_lib.Lock(workdir, "convert"):
    if hf_tokenizer.is_file():
      shutil.copyfile(hf_tokenizer, workdir.tokenizer)
    kept = _kept_files(source)
    if kept:
      (workdir.root / HF_FILES).mkdir(exist_ok=True)
    for path in kept:
      shutil.copyfile(path, workdir.root / HF_FILES / path.name)
    keep = config.training.max_checkpoints_to_keep
    if start is not None:
      checkpoint.save_start(workdir.checkpoints, 0, start, _FRESH_DATA_STATE, config, keep)
    else:  # An optimizer whose fresh state is not zeros: the whole state, as training saves it.
      state = state_lib.state_from_params(config, state_lib.make_optimizer(config), params)
      manager = checkpoint.make_manager(workdir.checkpoints, keep)
      checkpoint.save(manager, 0, state, _FRESH_DATA_STATE, config)
      checkpoint.wait(manager)
    workdir.config_json.write_text(config.to_json_best_effort(indent=2) + "\n")
    (workdir.root / HF_CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
  return config


def _start(config, params, mesh) -> Optional[dict]:
  """checkpoint.save_start's {"step", "params", "rng"} of the step-0 state that
  state_lib.state_from_params makes of the network's `params` (a learned schedule's θ added), or
  None if that state's EMA is not its params or its optimizer state not all zeros (save_start's
  premise). Worked out on a one-element stand-in for each param: nothing of their size is made."""
  stand_in = jax.tree.map(lambda a: np.ones((1,) * a.ndim, a.dtype), params)
  fresh = jax.device_get(
    state_lib.state_from_params(config, state_lib.make_optimizer(config), stand_in)
  )
  network = {key: value for key, value in fresh.params.items() if key in params}
  added = {key: value for key, value in fresh.params.items() if key not in params}
  same = lambda a, b: (
    jax.tree.structure(a) == jax.tree.structure(b)
    and all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  )
  zeros = all(not np.any(leaf) for leaf in jax.tree.leaves(fresh.opt_state))
  if not (zeros and same(network, stand_in) and same(fresh.ema_params, fresh.params)):
    logging.warning("The optimizer's fresh state is not zeros: saving the whole step-0 state.")
    return None
  put = lambda tree: jax.device_put(tree, sharding.replicated(mesh))
  return {"step": put(fresh.step), "params": {**params, **put(added)}, "rng": put(fresh.rng)}


def _converted_from(root: pathlib.Path, config) -> Optional[pathlib.Path]:
  """The converted workdir a run descends from: root itself, or the one its training.init_from
  chain started from (an SFT or LoRA run of a converted model); None for a model md4jax made."""
  seen = set()
  while not (root / HF_CONFIG_FILE).is_file():
    source = config.training.init_from
    if not source or root in seen:
      return None
    seen.add(root)
    root = pathlib.Path(source)
    try:
      config = config_lib.workdir_config(root, "training.init_from")
    except (ValueError, FileNotFoundError):
      return None
  return root


def export_hf(workdir, out, dtype_name=None, which: str = "ema", log=print) -> dict:
  """Writes the Hugging Face folder `out` of the workdir's newest checkpoint; returns its
  config.json."""
  workdir = workdir_lib.as_workdir(workdir)
  config = config_lib.workdir_config(workdir.root, "--in")
  options = hf_lib.md4jax_options(config)
  converted = _converted_from(workdir.root, config)
  base = json.loads((converted / HF_CONFIG_FILE).read_text()) if converted else None
  if dtype_name is None:
    saved = [base[k] for k in ("dtype", "torch_dtype") if base and base.get(k) in hf_folder.DTYPES]
    dtype_name = saved[0] if saved else "float32"
  mesh = Mesh(np.asarray([_cpu()]).reshape(1, 1, 1), sharding.MESH_AXES)
  loaded = load.load(
    workdir.root, params=which, mesh=mesh, role="--in", check_config=False, log=log
  )
  # LoRA adapters folded into their kernels: the folder holds the network they make.
  params = jax.device_get(lora.merged(objective.network_params(loaded.params), loaded.config))
  hf = hf_config.hf_config(options, dtype_name, loaded.config.data.seq_len, base)
  tensors = hf_tensors.from_md4jax(params, options, hf_folder.DTYPES[dtype_name], hf["model_type"])
  hf_folder.write_safetensors(pathlib.Path(out) / hf_folder.WEIGHTS_FILE, tensors, {"format": "pt"})
  hf_folder.write_config(out, hf)
  # md4jax's own char and byte tokenizers are no Hugging Face tokenizer.json: only a BPE's is.
  if workdir.tokenizer.is_file() and tokenizer_lib.load(workdir.tokenizer).kind == "bpe":
    shutil.copyfile(workdir.tokenizer, pathlib.Path(out) / hf_folder.TOKENIZER_FILE)
  elif converted and (converted / hf_folder.TOKENIZER_FILE).is_file():
    shutil.copyfile(
      converted / hf_folder.TOKENIZER_FILE, pathlib.Path(out) / hf_folder.TOKENIZER_FILE
    )
  if converted and (converted / HF_FILES).is_dir():
    for path in sorted((converted / HF_FILES).iterdir()):
      shutil.copyfile(path, pathlib.Path(out) / path.name)
  log(
    f"Wrote {out}: {hf['architectures'][0]} in {dtype_name}, step {loaded.step}'s {which} params."
  )
  if loaded.config.model.type == "mdm" and hf["model_type"] not in hf_config.DIFFUSION_TYPES:
    log(
      "Note: a model.type='mdm' model is a bidirectional denoiser without its mask row; "
      "transformers runs these weights as a causal LM."
    )
  return hf


def main(argv, cli: types.SimpleNamespace):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  if cli.source.value is None or cli.out.value is None:
    raise app.UsageError("--in and --out are required.")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  with user_errors.in_one_line("md4jax.convert", USER_ERRORS, flags.FLAGS["verbosity"].present):
    if cli.direction.value == "import":
      config = import_hf(
        cli.source.value,
        cli.out.value,
        cli.config.value,
        cli.model_type.value,
        cli.vocab_size.value,
      )
      print(
        f"Wrote {cli.out.value}: a model.type={config.model.type!r} model of "
        f"{config.model.num_layers} layers, vocab_size {config.data.vocab_size}. Continue it with\n"
        f"  python -m md4jax.main --config=configs/workdir.py:{cli.out.value} --workdir={cli.out.value}"
        " --mode=train|eval|sample"
      )
    else:
      export_hf(cli.source.value, cli.out.value, cli.dtype.value, cli.params.value)


if __name__ == "__main__":
  app.run(functools.partial(main, cli=_define_flags()), flags_parser=config_lib.parse_flags)
