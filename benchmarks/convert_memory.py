r"""Peak host memory of `python -m md4jax.convert` on a random LLaDA-shaped folder of about 1B
parameters, against the model's bytes; one JSON line per conversion measured.

  nice python benchmarks/convert_memory.py                       # ~0.95B params, 4 float32 shards
  nice python benchmarks/convert_memory.py --d_model=1024 --n_layers=8 --n_heads=8 \
      --mlp_hidden_size=2816 --old                               # 168M params, the old path beside

The folder (--dir, written once and reused) is what a sharded LLaDA checkpoint on disk looks like:
LLaDA's tensor names and config.json fields (as tests/golden/llada's), float32 tensors drawn
from N(0, 0.02²) split in state-dict order into --shards files with a model.safetensors.index.json,
and a word-level tokenizer.json with one token per id and <|mdm_mask|> at mask_token_id (the
converter checks a LLaDA folder's tokenizer against it). The conversion runs in a child process
(niced, JAX_PLATFORMS=cpu unless set: one host CPU device), and its peak resident memory is the
kernel's count for that child (ru_maxrss, file-backed pages included), read by a small launcher
process of its own.

--old also measures the pre-streaming import on the same folder, in its own child: every tensor
read at once (hf_folder.read_weights), converted in memory (hf_tensors.to_md4jax), the full train
state built on the host (params, EMA and Adam's two moments) and saved as the step-0 checkpoint.
It holds ~7x the model's bytes: run it on a model that fits (the second command above).

"ratio" is peak RSS / model bytes; "baseline_rss_bytes" is what the child's Python, JAX and
md4jax take before any weight (a child that imports md4jax.convert and exits).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

_DIR = flags.DEFINE_string("dir", "/tmp/md4jax_convert_memory", "Where the folder and workdirs go.")
_D_MODEL = flags.DEFINE_integer("d_model", 2048, "Width.")
_N_LAYERS = flags.DEFINE_integer("n_layers", 16, "Blocks.")
_N_HEADS = flags.DEFINE_integer("n_heads", 16, "Attention heads (as many key/value heads).")
_MLP = flags.DEFINE_integer("mlp_hidden_size", 5632, "SwiGLU hidden width.")
_VOCAB = flags.DEFINE_integer("vocab_size", 32000, "Token rows (untied embedding and head).")
_SHARDS = flags.DEFINE_integer("shards", 4, "safetensors files.")
_OLD = flags.DEFINE_bool("old", False, "Also measure the pre-streaming import (~7x the model).")
_KEEP = flags.DEFINE_bool("keep", False, "Keep the converted workdirs.")

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN_CONFIG = ROOT / "tests" / "golden" / "llada" / "config.json"
MASK_TOKEN = "<|mdm_mask|>"

# The import as it was before streaming (md4jax.convert.import_hf, less the copied files), through
# the library's in-memory functions: the whole folder read, converted, and the full state saved.
_OLD_IMPORT = """
import sys
import jax, jax.numpy as jnp
from md4jax.app import hf as hf_lib
from md4jax.model import hf_config, hf_folder, hf_tensors
from md4jax.runtime import workdir as workdir_lib
from md4jax.training import checkpoint
from md4jax.training import state as state_lib
source, out = sys.argv[1:3]
config, hf = hf_lib.folder_config(source)
params = hf_tensors.to_md4jax(
  hf_folder.read_weights(source), hf_config.model_options(hf), config.model.scan_layers, 0,
  hf["model_type"],
)
hf_lib.check_fits(config, params)
with jax.default_device(jax.local_devices(backend="cpu")[0]):
  state = state_lib.state_from_params(
    config, state_lib.make_optimizer(config), jax.tree.map(jnp.asarray, params)
  )
  manager = checkpoint.make_manager(workdir_lib.as_workdir(out).checkpoints, 1)
  checkpoint.save(manager, 0, state, {"next_batch_index": 0}, config)
  checkpoint.wait(manager)
"""


def _tensor_shapes() -> dict:
  """{LLaDA's tensor name: shape}, in state-dict order."""
  d, mlp, vocab = _D_MODEL.value, _MLP.value, _VOCAB.value
  shapes = {"model.transformer.wte.weight": (vocab, d)}
  for i in range(_N_LAYERS.value):
    block = f"model.transformer.blocks.{i}."
    for name, shape in (
      ("attn_out", (d, d)),
      ("attn_norm", (d,)),
      ("ff_norm", (d,)),
      ("ff_out", (d, mlp)),
      ("ff_proj", (mlp, d)),
      ("k_proj", (d, d)),
      ("q_proj", (d, d)),
      ("up_proj", (mlp, d)),
      ("v_proj", (d, d)),
    ):
      shapes[f"{block}{name}.weight"] = shape
  shapes["model.transformer.ln_f.weight"] = (d,)
  shapes["model.transformer.ff_out.weight"] = (vocab, d)
  return shapes


def _hf_config() -> dict:
  config = json.loads(GOLDEN_CONFIG.read_text())
  vocab = _VOCAB.value
  config.update(
    d_model=_D_MODEL.value,
    n_heads=_N_HEADS.value,
    n_kv_heads=_N_HEADS.value,
    n_layers=_N_LAYERS.value,
    mlp_hidden_size=_MLP.value,
    vocab_size=vocab,
    embedding_size=vocab,
    mask_token_id=vocab - 2,
    eos_token_id=vocab - 3,
    pad_token_id=vocab - 3,
    max_sequence_length=4096,
  )
  return config


def _write_tokenizer(path: pathlib.Path, vocab_size: int, mask_id: int):
  """A word-level tokenizer.json of vocab_size ids, <|mdm_mask|> at mask_id."""
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

  vocab = {f"t{i}": i for i in range(vocab_size)}
  del vocab[f"t{mask_id}"]
  vocab[MASK_TOKEN] = mask_id
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(path))


def write_folder(folder: pathlib.Path) -> dict:
  """Writes the random LLaDA folder unless the same one is there; returns its config.json."""
  import safetensors.numpy  # noqa: PLC0415

  config = _hf_config()
  shapes = _tensor_shapes()
  config_path = folder / "config.json"
  if config_path.is_file() and json.loads(config_path.read_text()) == config:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    if len(set(index["weight_map"].values())) == _SHARDS.value:
      return config
  shutil.rmtree(folder, ignore_errors=True)
  folder.mkdir(parents=True)
  total = sum(4 * int(np.prod(shape)) for shape in shapes.values())
  names = list(shapes)
  # State-dict order, cut where the running size passes each k / shards of the total.
  running, shard_of = 0, {}
  for name in names:
    shard_of[name] = min(running * _SHARDS.value // total, _SHARDS.value - 1)
    running += 4 * int(np.prod(shapes[name]))
  count = _SHARDS.value
  files = [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
  rng = np.random.default_rng(0)
  for k in range(count):
    tensors = {}
    for name in (n for n in names if shard_of[n] == k):
      tensor = rng.standard_normal(shapes[name], dtype=np.float32)
      tensor *= 0.02
      if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
        tensor += 1.0
      tensors[name] = tensor
    safetensors.numpy.save_file(tensors, str(folder / files[k]), {"format": "pt"})
    del tensors
  index = {"metadata": {"total_size": total}, "weight_map": {n: files[shard_of[n]] for n in names}}
  (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
  _write_tokenizer(folder / "tokenizer.json", _VOCAB.value, config["mask_token_id"])
  config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  return config


# Runs argv[2:] with its output in argv[1] and prints its peak RSS in kilobytes and its exit code.
# A small process of its own starts the measured one: Linux's ru_maxrss of a child counts the
# memory of the process that started it (its high-water mark at the fork or exec), so this
# benchmark, which held a shard in memory while writing it, must not be that process.
_LAUNCHER = """
import resource, subprocess, sys
with open(sys.argv[1], "w") as log:
  code = subprocess.run(sys.argv[2:], stdout=log, stderr=log).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)
"""


def _measure(command: list, log: pathlib.Path) -> tuple:
  """(peak RSS in bytes, seconds) of a niced child running `command`; its output goes to log."""
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")
  started = time.perf_counter()
  launched = subprocess.run(
    [sys.executable, "-c", _LAUNCHER, str(log), "nice", *command],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )
  seconds = time.perf_counter() - started
  kilobytes, code = map(int, launched.stdout.split())
  if code != 0:
    raise SystemExit(f"{' '.join(command)} failed; its output: {log}\n{log.read_text()[-3000:]}")
  return kilobytes * 1024, seconds  # Linux counts kilobytes.


def main(argv):
  del argv
  root = pathlib.Path(_DIR.value)
  root.mkdir(parents=True, exist_ok=True)
  shape = f"{_D_MODEL.value}x{_N_LAYERS.value}_{_MLP.value}_{_VOCAB.value}_{_SHARDS.value}"
  folder = root / f"llada_{shape}"
  started = time.perf_counter()
  write_folder(folder)
  print(f"folder {folder} ready ({time.perf_counter() - started:.0f}s)", file=sys.stderr)
  params = sum(int(np.prod(s)) for s in _tensor_shapes().values())
  model_bytes = 4 * params
  baseline, _ = _measure([sys.executable, "-c", "import md4jax.convert"], root / "baseline.log")
  runs = [("streaming", [sys.executable, "-m", "md4jax.convert", f"--in={folder}"])]
  if _OLD.value:
    runs.append(("old", [sys.executable, "-c", _OLD_IMPORT, str(folder)]))
  for path, command in runs:
    out = root / f"workdir_{path}"
    shutil.rmtree(out, ignore_errors=True)
    command = [*command, f"--out={out}"] if path == "streaming" else [*command, str(out)]
    peak, seconds = _measure(command, root / f"{path}.log")
    checkpoint_bytes = sum(
      p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file()
    )
    print(
      json.dumps(
        {
          "path": path,
          "params": params,
          "model_bytes": model_bytes,
          "shards": _SHARDS.value,
          "peak_rss_bytes": peak,
          "ratio": round(peak / model_bytes, 3),
          "baseline_rss_bytes": baseline,
          "checkpoint_bytes": checkpoint_bytes,
          "seconds": round(seconds, 1),
        }
      ),
      flush=True,
    )
    if not _KEEP.value:
      shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
