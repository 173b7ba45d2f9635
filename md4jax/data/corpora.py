"""Text corpora as re-iterable document collections with train/validation splits.

A `Corpus` holds splits, each an iterable of documents (str) that can be
iterated more than once (once to train a tokenizer, once to tokenize) and is
read lazily, so a corpus need not fit in memory.

Sources:
  text8(path)           a text8-format file or text8.zip; 90/5/5 by position.
  local_corpus(path)    a .txt file (one document per non-empty line), a .jsonl
                        file (one document per line, in a text field), or a
                        folder of such files; the last 5% of documents validate.
  conditional(path)     prompt/response pairs, one JSON record per line of
                        .jsonl files, split like local_corpus; documents are
                        `Example(prompt, response, where)`, where = "file:line".
Local files are read by md4jax.data.documents.
  lm1b(path), openwebtext(path)
                        the MDLM corpora from a local folder (same reader), or
                        through tensorflow-datasets / Hugging Face datasets.
Nothing downloads unless `download_text8` or a network loader is called.
"""

import dataclasses
import pathlib
import urllib.request
import zipfile
from typing import Iterable, Iterator, Optional

from md4jax.data import documents

TEXT8_URL = "http://mattmahoney.net/dc/text8.zip"
TEXT8_ALPHABET = "abcdefghijklmnopqrstuvwxyz "
# Folder layouts with explicit splits; the first validation name found is used.
VALIDATION_DIRS = ("validation", "valid", "test")
# OpenWebText has no held-out split; MDLM holds out its last 100k documents.
OWT_NUM_VALIDATION = 100_000
DATASETS = ("text8", "localtext", "conditional", "lm1b", "owt")


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Document splits; `key` identifies the content (for tokenization caches)."""

  name: str
  train: Iterable[str]
  validation: Iterable[str]
  test: Optional[Iterable[str]] = None
  key: str = ""


# ---------------------------------------------------------------- text8


def download_text8(dest) -> pathlib.Path:
  """Downloads text8.zip to `dest` (a folder or file path); only when called."""
  dest = pathlib.Path(dest)
  if dest.is_dir():
    dest = dest / "text8.zip"
  dest.parent.mkdir(parents=True, exist_ok=True)
  tmp = dest.with_suffix(dest.suffix + ".part")
  urllib.request.urlretrieve(TEXT8_URL, tmp)
  tmp.replace(dest)
  return dest


def read_text8(path) -> str:
  """The text of a text8-format file (or a .zip holding one), validated."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(
      f"text8 path {str(path)!r} is not a file (expected text8 or text8.zip)."
    )
  if zipfile.is_zipfile(path):
    with zipfile.ZipFile(path) as zf:
      names = [n for n in zf.namelist() if not n.endswith("/")]
      if len(names) != 1:
        raise ValueError(f"{path} should hold exactly one file (text8), found {names[:5]}.")
      raw = zf.read(names[0])
  else:
    raw = path.read_bytes()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError:
    raise documents.not_utf8_error(path, raw) from None
  # Editors append a line break; anything else outside the alphabet is an error.
  text = text.rstrip("\r\n")
  if not text:
    raise ValueError(f"text8 file {path} is empty.")
  bad = set(text) - set(TEXT8_ALPHABET)
  if bad:
    first = min(text.find(c) for c in bad)
    raise ValueError(
      f"{path} is not text8-format (only a-z and space allowed): found "
      f"{sorted(bad)[:10]!r}, first at character {first}: "
      f"{text[max(0, first - 20) : first + 20]!r}."
    )
  return text


def text8_splits(text: str) -> tuple:
  """(train, validation, test) by position: 90%/5%/5%.

  For the full 100M-character text8 this is the standard 90M/5M/5M split.
  """
  n = len(text)
  a, b = n * 9 // 10, n * 19 // 20
  return text[:a], text[a:b], text[b:]


def text8(path) -> Corpus:
  """text8 as three single-document splits."""
  train, validation, test = text8_splits(read_text8(path))
  for name, split in (("train", train), ("validation", validation), ("test", test)):
    if not split:
      raise ValueError(f"text8 file {path} is too short: its {name} split is empty.")
  return Corpus("text8", [train], [validation], [test], key=f"text8:{documents.file_key([path])}")


# ---------------------------------------------------------------- local files


def local_corpus(
  path,
  *,
  text_field: str = "text",
  validation_fraction: float = 0.05,
  max_validation: Optional[int] = None,
  name: str = "localtext",
  pair_fields: Optional[tuple] = None,
) -> Corpus:
  """Documents from a file or folder; see the module docstring for the formats.

  With pair_fields = (prompt field, response field), JSONL Examples (see `conditional`).

  A folder with a `train/` and a `validation/` (or `valid/`, `test/`) subfolder
  or file uses those splits. Otherwise the last `validation_fraction` of the
  documents validate: at least 1, at most `max_validation` (if given).
  """
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"Corpus path {str(path)!r} does not exist.")
  if path.is_dir() and (path / "train").exists():
    held_out = [path / d for d in VALIDATION_DIRS if (path / d).exists()]
    if not held_out:
      raise ValueError(f"{path} has a train/ split but none of {VALIDATION_DIRS}.")
    train = documents.Documents(
      documents.list_files(path / "train"), text_field, pair_fields=pair_fields
    )
    validation = documents.Documents(
      documents.list_files(held_out[0]), text_field, pair_fields=pair_fields
    )
  else:
    docs = documents.Documents(documents.list_files(path), text_field, pair_fields=pair_fields)
    n = len(docs)
    if n < 2:
      raise ValueError(
        f"{path} holds {n} document(s); a train and a validation split need at "
        "least 2 (one per non-empty line, or per JSONL record)."
      )
    k = max(1, round(n * validation_fraction))
    k = min(k, max_validation) if max_validation else k
    if not 0 < k < n:
      raise ValueError(f"Holding out {k} of {n} documents of {path} leaves an empty split.")
    train, validation = docs.split(n - k)
  for split_name, split in (("train", train), ("validation", validation)):
    if not len(split):
      raise ValueError(f"The {split_name} split of {path} holds no documents.")
  return Corpus(name, train, validation, key=f"{name}:{train.key()}|{validation.key()}")


def conditional(path, *, prompt_field: str = "prompt", response_field: str = "response") -> Corpus:
  """Prompt/response pairs from a .jsonl file or folder, split like local_corpus.

  Each non-blank line is a JSON record with string fields prompt_field and
  response_field; the documents are Examples.
  """
  return local_corpus(path, name="conditional", pair_fields=(prompt_field, response_field))


# ---------------------------------------------------------------- LM1B, OpenWebText


class _TfdsDocuments:
  """The text feature of a tfds split, read through TensorFlow on each iteration."""

  def __init__(self, name: str, split: str, data_dir: Optional[str]):
    self.name, self.split, self.data_dir = name, split, data_dir

  def __iter__(self) -> Iterator[str]:
    try:
      import tensorflow  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      raise ImportError(
        f"Reading {self.name!r} through tensorflow-datasets needs TensorFlow, which is "
        "optional: pip install 'md4jax[tf]', or set config.data.path to a local folder of "
        ".txt/.jsonl files."
      ) from None
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    ds = tfds.load(self.name, split=self.split, data_dir=self.data_dir, shuffle_files=False)
    for example in tfds.as_numpy(ds):
      yield example["text"].decode("utf-8")


class _HfDocuments:
  """Rows [start, stop) of a Hugging Face dataset's text column."""

  def __init__(self, dataset, start: int, stop: int, text_field: str = "text"):
    self.dataset, self.start, self.stop, self.text_field = dataset, start, stop, text_field

  def __len__(self) -> int:
    return self.stop - self.start

  def __iter__(self) -> Iterator[str]:
    for row in self.dataset.select(range(self.start, self.stop)):
      yield row[self.text_field]


def lm1b(path=None, *, data_dir: Optional[str] = None, text_field: str = "text") -> Corpus:
  """LM1B sentences: from a local folder/file if `path`, else tfds 'lm1b' (train/test)."""
  if path:
    return local_corpus(path, text_field=text_field, name="lm1b")
  return Corpus(
    "lm1b",
    _TfdsDocuments("lm1b", "train", data_dir),
    _TfdsDocuments("lm1b", "test", data_dir),
    key=f"lm1b:tfds:{data_dir}",
  )


def openwebtext(
  path=None, *, text_field: str = "text", num_validation: int = OWT_NUM_VALIDATION
) -> Corpus:
  """OpenWebText; its last `num_validation` documents validate (MDLM).

  From a local folder/file if `path` (a stand-in with fewer than 20 *
  num_validation documents holds out its last 5% instead), else through the
  Hugging Face `datasets` package (network).
  """
  if path:
    return local_corpus(path, text_field=text_field, max_validation=num_validation, name="owt")
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(
      "Reading OpenWebText without a local path needs the Hugging Face "
      "`datasets` package (pip install datasets) and a network; or set "
      "config.data.path to a local folder of .txt/.jsonl files."
    ) from None
  ds = datasets.load_dataset("Skylion007/openwebtext", split="train")
  n = len(ds)
  return Corpus(
    "owt",
    _HfDocuments(ds, 0, n - num_validation, text_field),
    _HfDocuments(ds, n - num_validation, n, text_field),
    key=f"owt:hf:{n}",
  )


def load_corpus(
  dataset: str,
  path: str = "",
  *,
  text_field: str = "text",
  prompt_field: str = "prompt",
  response_field: str = "response",
) -> Corpus:
  """The corpus named by config.data.dataset, read from config.data.path."""
  if dataset == "text8":
    if not path:
      raise ValueError(
        "dataset 'text8' needs config.data.path (a text8 or text8.zip file; "
        "md4jax.data.corpora.download_text8 fetches one)."
      )
    return text8(path)
  if dataset == "localtext":
    if not path:
      raise ValueError("dataset 'localtext' needs config.data.path (a .txt/.jsonl file or folder).")
    return local_corpus(path, text_field=text_field)
  if dataset == "conditional":
    if not path:
      raise ValueError("dataset 'conditional' needs config.data.path (a .jsonl file or folder).")
    return conditional(path, prompt_field=prompt_field, response_field=response_field)
  if dataset == "lm1b":
    return lm1b(path or None, text_field=text_field)
  if dataset == "owt":
    return openwebtext(path or None, text_field=text_field)
  raise ValueError(f"Unknown dataset {dataset!r}; valid: {', '.join(DATASETS)}.")
