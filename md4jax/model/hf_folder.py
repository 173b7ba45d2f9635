"""A Hugging Face model folder on disk: its config.json and safetensors weights, read and written.

The safetensors format is an 8-byte little-endian header length, a JSON header naming every
tensor's dtype, shape and byte range, and the raw little-endian bytes. It is read and written
here with NumPy (memory-mapped on read) because the safetensors package's NumPy API has no
bfloat16, the dtype most checkpoints are stored in; ml_dtypes (a JAX dependency) gives NumPy
one. The writer lays the file out as the safetensors library does (compact JSON, metadata first,
tensors by name, the header padded with spaces to 8 bytes), so one it wrote reads back bit for bit
in either.
"""

import json
import os
import pathlib
import tempfile

import ml_dtypes
import numpy as np

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
# safetensors dtype names <-> NumPy's (the float dtypes checkpoints hold).
_DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def read_config(folder) -> dict:
  """The folder's config.json; FileNotFoundError / ValueError naming what is wrong."""
  path = pathlib.Path(folder) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(
      f"No {CONFIG_FILE} in {folder}: give a Hugging Face model folder (config.json and "
      "*.safetensors, as save_pretrained writes)."
    )
  try:
    config = json.loads(path.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not JSON ({e}).") from None
  if not isinstance(config, dict):
    raise ValueError(f"{path} holds JSON {type(config).__name__}, not an object.")
  return config


def read_safetensors(path) -> dict:
  """{name: NumPy array (memory-mapped, read-only)} of one safetensors file."""
  path = pathlib.Path(path)
  with open(path, "rb") as f:
    size_bytes = f.read(8)
    header_size = int.from_bytes(size_bytes, "little") if len(size_bytes) == 8 else -1
    if not 0 < header_size <= path.stat().st_size - 8:
      raise ValueError(f"{path} is not a safetensors file (no header).")
    try:
      header = json.loads(f.read(header_size))
    except (UnicodeDecodeError, json.JSONDecodeError):
      raise ValueError(f"{path} is not a safetensors file (its header is not JSON).") from None
  header.pop("__metadata__", None)
  data_size = path.stat().st_size - 8 - header_size
  data = np.memmap(path, np.uint8, "r", offset=8 + header_size) if data_size else np.zeros(0)
  tensors = {}
  for name, spec in header.items():
    if spec["dtype"] not in _DTYPES:
      raise ValueError(f"{path}: tensor {name!r} is {spec['dtype']}, not a float dtype.")
    start, end = spec["data_offsets"]
    tensors[name] = data[start:end].view(_DTYPES[spec["dtype"]]).reshape(spec["shape"])
  return tensors


def read_weights(folder) -> dict:
  """Every tensor of the folder's *.safetensors files (one, or the shards of a large model)."""
  files = sorted(pathlib.Path(folder).glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(
      f"No *.safetensors file in {folder}: md4jax reads safetensors only (a pytorch_model.bin "
      "can be rewritten with save_pretrained(..., safe_serialization=True))."
    )
  tensors = {}
  for path in files:
    shard = read_safetensors(path)
    repeated = sorted(set(shard) & set(tensors))
    if repeated:
      raise ValueError(f"{path} repeats tensors of another shard: {repeated[:3]}.")
    tensors.update(shard)
  return tensors


def write_safetensors(path, tensors: dict, metadata: dict):
  """Writes {name: NumPy array} to `path` (atomically: a reader never sees half a file)."""
  path = pathlib.Path(path)
  header, offset = {"__metadata__": metadata}, 0
  arrays = {name: np.ascontiguousarray(tensors[name]) for name in sorted(tensors)}
  for name, array in arrays.items():
    if array.dtype not in _NAMES:
      raise ValueError(f"Tensor {name!r} is {array.dtype}; safetensors holds float dtypes here.")
    header[name] = {
      "dtype": _NAMES[array.dtype],
      "shape": list(array.shape),
      "data_offsets": [offset, offset + array.nbytes],
    }
    offset += array.nbytes
  text = json.dumps(header, separators=(",", ":")).encode("utf-8")
  text += b" " * (-len(text) % 8)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
  with os.fdopen(fd, "wb") as f:
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for array in arrays.values():
      f.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
  os.replace(tmp, path)


def write_config(folder, config: dict):
  path = pathlib.Path(folder) / CONFIG_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
