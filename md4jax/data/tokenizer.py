"""Tokenizers: characters, UTF-8 bytes, or a Hugging Face `tokenizer.json`.

All share one small interface:

  encode(text) -> np.ndarray[int32]     decode(ids) -> str
  vocab_size: int                       eos_id: int | None
  save(directory)                       (writes directory/tokenizer.json)

`load(path)` reads any of them back from a directory or a tokenizer.json file,
and `make_tokenizer` returns the one saved in a workdir (resume) or builds,
trains and saves a new one. Nothing here downloads anything.

EOS is a special id that ends every document (the pipeline appends it). It has
no text of its own: `decode` renders it as a newline, the document separator of
local text files, so decoded samples show one document per line.
"""

import functools
import json
import os
import pathlib
import tempfile
from typing import Iterable, Optional, Sequence, Union

import numpy as np

TOKENIZER_FILE = "tokenizer.json"
KINDS = ("char", "byte", "bpe", "text8")
# text8's 27 symbols; a=0 ... z=25, space=26, as md4jax.data.sources and its checkpoints use.
TEXT8_ALPHABET = "abcdefghijklmnopqrstuvwxyz "
# Special tokens that end a document in common tokenizer.json files (GPT-2, BERT, T5/Llama).
_EOS_CANDIDATES = ("<|endoftext|>", "[SEP]", "</s>", "<eos>")
BPE_EOS = "<|endoftext|>"

PathLike = Union[str, os.PathLike]


def _write_atomic(path: pathlib.Path, text: str):
  # Several processes may save the same tokenizer; readers must never see half a file.
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def _as_ids(ids, vocab_size: int) -> np.ndarray:
  """Flat int64 ids, checked to lie in [0, vocab_size) (the mask id does not decode)."""
  ids = np.asarray(ids, dtype=np.int64).reshape(-1)
  bad = ids[(ids < 0) | (ids >= vocab_size)]
  if bad.size:
    raise ValueError(
      f"Cannot decode ids outside [0, {vocab_size}): {sorted(set(bad.tolist()))[:10]}."
    )
  return ids


class CharTokenizer:
  """One id per character of a fixed alphabet, then an optional EOS id.

  Ids are the alphabet positions; EOS (if any) is len(alphabet). Unknown
  characters raise a ValueError that names them and where they occur.
  """

  kind = "char"

  def __init__(self, alphabet: str, eos: bool = False):
    if not alphabet:
      raise ValueError("CharTokenizer needs a non-empty alphabet.")
    if len(set(alphabet)) != len(alphabet):
      raise ValueError(f"CharTokenizer alphabet has repeated characters: {alphabet!r}")
    self.alphabet = alphabet
    self.eos_id = len(alphabet) if eos else None
    self.vocab_size = len(alphabet) + int(eos)
    codes = np.array([ord(c) for c in alphabet], np.int64)
    self._codes, self._chars = codes, np.array(list(alphabet))
    # Dense code-point lookup; -1 marks characters outside the alphabet.
    self._lookup = np.full(int(codes.max()) + 1, -1, np.int32)
    self._lookup[codes] = np.arange(len(alphabet), dtype=np.int32)

  @classmethod
  def text8(cls) -> "CharTokenizer":
    """The 27-symbol text8 vocabulary: a=0 ... z=25, space=26; no EOS."""
    return cls(TEXT8_ALPHABET, eos=False)

  @classmethod
  def from_texts(cls, texts: Iterable[str], eos: bool = True) -> "CharTokenizer":
    """The sorted set of characters of `texts` (e.g. the training documents)."""
    chars = set()
    for text in texts:
      chars.update(text)
    if not chars:
      raise ValueError("Cannot build a character vocabulary from empty text.")
    return cls("".join(sorted(chars)), eos=eos)

  def encode(self, text: str) -> np.ndarray:
    # UTF-32 gives one code point per element, so a whole document is encoded
    # by one numpy gather, not a Python loop over its characters (docs/performance.md).
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32).astype(np.int64)
    top = len(self._lookup) - 1
    ids = np.where(codes <= top, self._lookup[np.minimum(codes, top)], -1)
    if (ids < 0).any():
      where = np.flatnonzero(ids < 0)
      bad = sorted({text[i] for i in where[:1000]})[:10]
      raise ValueError(
        f"Characters outside the tokenizer's {len(self.alphabet)}-symbol alphabet: "
        f"{bad!r} ({len(where)} occurrences, first at character {where[0]}: "
        f"{text[max(0, where[0] - 20) : where[0] + 20]!r})."
      )
    return ids.astype(np.int32)

  def decode(self, ids) -> str:
    ids = _as_ids(ids, self.vocab_size)
    chars = np.where(ids == self.eos_id, "\n", self._chars[np.minimum(ids, len(self.alphabet) - 1)])
    return "".join(chars.tolist())

  @functools.cached_property
  def byte_lengths(self) -> np.ndarray:
    """UTF-8 bytes each id stands for [vocab_size]; EOS is one (a line break)."""
    return np.asarray(
      [len(c.encode("utf-8")) for c in self.alphabet] + [1] * (self.eos_id is not None)
    )

  def to_json(self) -> dict:
    return {
      "md4jax_tokenizer": self.kind,
      "alphabet": self.alphabet,
      "eos": self.eos_id is not None,
    }

  def save(self, directory: PathLike) -> pathlib.Path:
    path = pathlib.Path(directory) / TOKENIZER_FILE
    _write_atomic(path, json.dumps(self.to_json(), ensure_ascii=False, indent=1))
    return path


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, then an optional EOS id 256."""

  kind = "byte"

  def __init__(self, eos: bool = True):
    self.eos_id = 256 if eos else None
    self.vocab_size = 256 + int(eos)

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    ids = _as_ids(ids, self.vocab_size)
    # A sample may cut a multi-byte character; show U+FFFD rather than fail.
    raw = np.where(ids == self.eos_id, ord("\n"), ids).astype(np.uint8).tobytes()
    return raw.decode("utf-8", errors="replace")

  @functools.cached_property
  def byte_lengths(self) -> np.ndarray:
    """One byte per id; EOS is one (a line break)."""
    return np.ones(self.vocab_size, np.int64)

  def to_json(self) -> dict:
    return {"md4jax_tokenizer": self.kind, "eos": self.eos_id is not None}

  def save(self, directory: PathLike) -> pathlib.Path:
    path = pathlib.Path(directory) / TOKENIZER_FILE
    _write_atomic(path, json.dumps(self.to_json(), indent=1))
    return path


class BpeTokenizer:
  """A Hugging Face `tokenizers.Tokenizer`: a byte-level BPE trained here, or any tokenizer.json.

  Loading a local tokenizer.json is how the BERT-base-uncased (LM1B) and GPT-2
  (OpenWebText) tokenizers are used offline. `encode` adds no special tokens
  (no [CLS]/[SEP] from BERT's post-processor); documents are ended by EOS,
  which is the first of <|endoftext|>, [SEP], </s>, <eos> in the vocabulary.
  """

  kind = "bpe"

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    self.eos_id = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int) -> "BpeTokenizer":
    """Byte-level BPE (GPT-2 style) with `vocab_size` ids; id 0 is the EOS <|endoftext|>."""
    # pylint: disable-next=g-import-not-at-top
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
      raise ValueError(
        f"bpe vocab_size={vocab_size} is smaller than the {len(alphabet)} byte "
        "symbols plus EOS it must hold."
      )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[BPE_EOS],
      initial_alphabet=alphabet,
      show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return cls(tok)

  @classmethod
  def from_file(cls, path: PathLike) -> "BpeTokenizer":
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top

    return cls(Tokenizer.from_file(str(path)))

  @classmethod
  def from_pretrained(cls, name: str) -> "BpeTokenizer":
    """`name`'s tokenizer.json from the Hugging Face Hub; needs a network."""
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top

    try:
      return cls(Tokenizer.from_pretrained(name))
    except Exception as e:  # The Hub client raises many types; all mean "not available".
      raise RuntimeError(
        f"Could not fetch the {name!r} tokenizer from the Hugging Face Hub ({e}). "
        "Offline, download its tokenizer.json elsewhere and set "
        "config.data.tokenizer_path to it."
      ) from e

  @functools.cached_property
  def byte_lengths(self) -> Optional[np.ndarray]:
    """UTF-8 bytes each id stands for [vocab_size] for byte-level BPEs (GPT-2's, ours), else None.

    A byte-level token is spelled with one symbol per byte; EOS counts one byte (a
    line break), other special tokens their text. WordPiece and the like add and
    drop spaces when decoding, so their ids have no exact byte count.
    """
    from tokenizers import decoders  # pylint: disable=g-import-not-at-top

    if not isinstance(self.tokenizer.decoder, decoders.ByteLevel):
      return None
    special = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
    lengths = np.zeros(self.vocab_size, np.int64)
    for i in range(self.vocab_size):
      token = self.tokenizer.id_to_token(i) or ""
      lengths[i] = (
        1 if i == self.eos_id else len(special[i].encode("utf-8")) if i in special else len(token)
      )
    return lengths

  def to_json(self) -> dict:
    return json.loads(self.tokenizer.to_str())

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list:
    """Encodes many documents at once (in parallel, in Rust)."""
    encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, np.int32) for e in encodings]

  def decode(self, ids) -> str:
    ids = _as_ids(ids, self.vocab_size)
    # Decode each document separately so EOS shows as a line break.
    pieces = np.split(ids, np.flatnonzero(ids == self.eos_id)) if self.eos_id is not None else [ids]
    texts = [
      self.tokenizer.decode(p[p != self.eos_id].tolist(), skip_special_tokens=False) for p in pieces
    ]
    return "\n".join(texts)

  def save(self, directory: PathLike) -> pathlib.Path:
    path = pathlib.Path(directory) / TOKENIZER_FILE
    _write_atomic(path, self.tokenizer.to_str(pretty=True))
    return path


Tokenizer = Union[CharTokenizer, ByteTokenizer, BpeTokenizer]


def load(path: PathLike) -> Tokenizer:
  """Reads a tokenizer from a tokenizer.json file or a directory that holds one."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / TOKENIZER_FILE
  if not path.is_file():
    raise FileNotFoundError(
      f"No tokenizer file at {str(path)!r}; give config.data.tokenizer_path "
      "a tokenizer.json (or a folder holding one)."
    )
  try:
    spec = json.loads(path.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(
      f"{path} is not a tokenizer file: not JSON ({e}); give a Hugging Face "
      "tokenizer.json or one md4jax saved."
    ) from None
  if not isinstance(spec, dict):
    raise ValueError(f"{path} is not a tokenizer file: JSON {type(spec).__name__}, not an object.")
  kind = spec.get("md4jax_tokenizer")
  if kind == "char":
    return CharTokenizer(spec["alphabet"], eos=spec["eos"])
  if kind == "byte":
    return ByteTokenizer(eos=spec["eos"])
  if kind is not None:
    raise ValueError(f"{path}: unknown md4jax_tokenizer kind {kind!r}.")
  try:
    return BpeTokenizer.from_file(path)
  except Exception as e:  # pylint: disable=broad-except  (the Rust library's own error type)
    raise ValueError(
      f"{path} is not a tokenizer file the tokenizers library reads "
      f"({' '.join(str(e).split())[:200]})."
    ) from None


def make_tokenizer(
  kind: str,
  *,
  train_text_iter: Optional[Iterable[str]] = None,
  vocab_size: Optional[int] = None,
  path: Optional[PathLike] = None,
  workdir: Optional[PathLike] = None,
) -> Tokenizer:
  """The tokenizer saved in `workdir` if there is one (resume), else a new one, saved there.

  Args:
    kind: "text8" (27 symbols), "char" (alphabet of `train_text_iter`, plus EOS),
      "byte" (256 byte ids plus EOS) or "bpe" (`path` if given, else a byte-level
      BPE of `vocab_size` ids trained on `train_text_iter`).
    train_text_iter: training documents; needed for a new "char" or trained "bpe".
    vocab_size: size of a trained BPE vocabulary.
    path: a tokenizer.json (file or directory) to use as is, e.g. GPT-2's.
    workdir: where the tokenizer is saved and, on resume, read back from.
  """
  if kind not in KINDS:
    raise ValueError(f"Unknown tokenizer kind {kind!r}; valid: {', '.join(KINDS)}.")
  saved = pathlib.Path(workdir) / TOKENIZER_FILE if workdir else None
  if saved is not None and saved.is_file():
    tok = load(saved)
    if tok.kind != ("char" if kind == "text8" else kind):
      raise ValueError(
        f"{saved} holds a {tok.kind!r} tokenizer but {kind!r} was asked for; "
        "use a new workdir or the same tokenizer kind."
      )
    return tok
  if kind == "text8":
    tok = CharTokenizer.text8()
  elif kind == "byte":
    tok = ByteTokenizer()
  elif path:
    tok = load(path)
    if tok.kind != kind:
      raise ValueError(f"{path} holds a {tok.kind!r} tokenizer, not {kind!r}.")
  elif train_text_iter is None:
    raise ValueError(f"A new {kind!r} tokenizer needs training text (train_text_iter) or a path.")
  elif kind == "char":
    tok = CharTokenizer.from_texts(train_text_iter)
  else:
    if not vocab_size:
      raise ValueError("Training a BPE tokenizer needs vocab_size (config.data.bpe_vocab_size).")
    tok = BpeTokenizer.train(train_text_iter, vocab_size)
  if saved is not None:
    tok.save(saved.parent)
  return tok
