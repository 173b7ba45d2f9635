"""A Hugging Face model folder on disk: its config.json and safetensors weights, read and written.

Weights go through the safetensors library's NumPy API, whose serializer is the one transformers'
save_pretrained calls, so a file written here is byte for byte the file transformers writes. It
reads and writes bfloat16 (the dtype most checkpoints are stored in) as ml_dtypes' NumPy dtype,
which importing ml_dtypes registers (safetensors >= 0.4.2; checked down to that version). The NumPy
API rather than the Flax one: jnp arrays would narrow float64 tensors when jax_enable_x64 is off,
and the conversion reorders tensors on the host anyway.

A large model is read tensor by tensor (`tensor_headers`, then `read_tensor` or `stream_tensors`):
the headers first, so that a missing, extra or misshapen tensor is named before any weight is
read, then one tensor at a time, each file opened for that tensor alone. safetensors maps a file
into memory, and every page of it a read touched counts in the process's resident memory until
the file is closed: a shard held open while all its tensors are read would hold the whole shard.
"""

import dataclasses
import json
import os
import pathlib
import tempfile
from typing import Iterator

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
INDEX_FILE = "model.safetensors.index.json"  # A sharded model's {tensor: shard file} map.
# The float dtypes checkpoints hold (bfloat16 is ml_dtypes'; importing it lets safetensors name it).
_FLOAT_DTYPES = tuple(map(np.dtype, (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)))
DTYPE_NAMES = tuple(dtype.name for dtype in _FLOAT_DTYPES)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# safetensors' dtype names (a header's "dtype") as NumPy's, for the float ones and the messages.
_HEADER_DTYPES = {
  "F64": "float64",
  "F32": "float32",
  "F16": "float16",
  "BF16": "bfloat16",
  "I64": "int64",
  "I32": "int32",
  "I16": "int16",
  "I8": "int8",
  "U64": "uint64",
  "U32": "uint32",
  "U16": "uint16",
  "U8": "uint8",
  "BOOL": "bool",
}


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
  """{name: NumPy array} of one safetensors file (float tensors only: weights, not buffers)."""
  try:
    tensors = safetensors.numpy.load_file(path)
  except safetensors.SafetensorError as e:
    raise ValueError(f"{path} is not a safetensors file ({e}).") from None
  for name in sorted(tensors):
    if tensors[name].dtype not in _FLOAT_DTYPES:
      raise ValueError(f"{path}: tensor {name!r} is {tensors[name].dtype}, not a float dtype.")
  return tensors


def weight_files(folder) -> list:
  """The folder's *.safetensors files (one, or the shards of a large model), sorted; every shard
  its model.safetensors.index.json names must be there."""
  files = sorted(pathlib.Path(folder).glob("*.safetensors"))
  index = pathlib.Path(folder) / INDEX_FILE
  if index.is_file():  # A sharded model: every shard its index names must be there.
    try:
      listed = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"{index} is not a safetensors index ({e!r}).") from None
    missing = sorted(name for name in listed if not (pathlib.Path(folder) / name).is_file())
    if missing:
      raise FileNotFoundError(
        f"{folder}: {INDEX_FILE} lists {len(missing)} shard(s) that are not there: "
        f"{', '.join(missing[:3])}."
      )
  if not files:
    raise FileNotFoundError(
      f"No *.safetensors file in {folder}: md4jax reads safetensors only (a pytorch_model.bin "
      "can be rewritten with save_pretrained(..., safe_serialization=True))."
    )
  return files


def read_weights(folder) -> dict:
  """Every tensor of the folder's *.safetensors files (one, or the shards of a large model), in
  memory at once (`stream_tensors` reads them one at a time)."""
  tensors = {}
  for path in weight_files(folder):
    shard = read_safetensors(path)
    repeated = sorted(set(shard) & set(tensors))
    if repeated:
      raise ValueError(f"{path} repeats tensors of another shard: {repeated[:3]}.")
    tensors.update(shard)
  return tensors


@dataclasses.dataclass(frozen=True)
class Header:
  """One tensor of a safetensors file, as its header describes it (no data read)."""

  path: pathlib.Path  # The file that holds it.
  shape: tuple
  dtype: str  # NumPy's name of it: "float32", "bfloat16", ...


def _open(path):
  try:
    return safetensors.safe_open(str(path), framework="numpy")
  except (safetensors.SafetensorError, OSError) as e:
    raise ValueError(f"{path} is not a safetensors file ({e}).") from None


def tensor_headers(folder) -> dict:
  """{name: Header} of every tensor of the folder's safetensors files, in the order they lie on
  disk (file by file, by offset), read from the files' headers alone; the errors of
  `read_weights` (a non-float tensor, a tensor in two shards) without reading any weight."""
  headers = {}
  for path in weight_files(folder):
    with _open(path) as file:
      names = file.offset_keys() if hasattr(file, "offset_keys") else file.keys()
      shard = {}
      for name in names:
        piece = file.get_slice(name)
        code = piece.get_dtype()
        shard[name] = Header(path, tuple(piece.get_shape()), _HEADER_DTYPES.get(code, code))
    for name in sorted(shard):
      if shard[name].dtype not in DTYPE_NAMES:
        raise ValueError(f"{path}: tensor {name!r} is {shard[name].dtype}, not a float dtype.")
    repeated = sorted(set(shard) & set(headers))
    if repeated:
      raise ValueError(f"{path} repeats tensors of another shard: {repeated[:3]}.")
    headers.update(shard)
  return headers


def read_tensor(path, name: str) -> np.ndarray:
  """One tensor of a safetensors file, as a NumPy array of its own (the file closed again, so
  none of its pages stays mapped)."""
  with _open(path) as file:
    return file.get_tensor(name)


def stream_tensors(headers: dict) -> Iterator[tuple]:
  """(name, NumPy array) of each tensor `headers` (tensor_headers') names, one at a time in their
  order: the caller releases each before the next is read."""
  for name, header in headers.items():
    yield name, read_tensor(header.path, name)


def write_safetensors(path, tensors: dict, metadata: dict):
  """Writes {name: NumPy array} to `path` (atomically: a reader never sees half a file)."""
  path = pathlib.Path(path)
  for name, array in tensors.items():
    if array.dtype not in _FLOAT_DTYPES:
      raise ValueError(f"Tensor {name!r} is {array.dtype}; safetensors holds float dtypes here.")
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
  os.close(fd)
  try:
    # Contiguous: the serializer copies each array's buffer as it lies, transposed views included.
    arrays = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    safetensors.numpy.save_file(arrays, tmp, metadata)
    os.replace(tmp, path)
  finally:
    pathlib.Path(tmp).unlink(missing_ok=True)


def write_config(folder, config: dict):
  path = pathlib.Path(folder) / CONFIG_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
