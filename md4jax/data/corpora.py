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
  lm1b(path), openwebtext(path)
                        the MDLM corpora from a local folder (same reader), or
                        through tensorflow-datasets / Hugging Face datasets.
Nothing downloads unless `download_text8` or a network loader is called.
"""

import codecs
import dataclasses
import json
import pathlib
import urllib.request
import zipfile
from typing import Iterable, Iterator, NamedTuple, Optional, Sequence

TEXT8_URL = "http://mattmahoney.net/dc/text8.zip"
TEXT8_ALPHABET = "abcdefghijklmnopqrstuvwxyz "
TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
# Lines of only these characters hold no document (bytes.strip()'s set, for counting).
_ASCII_SPACE = " \t\n\r\x0b\x0c"
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


def not_utf8_error(path, data: Optional[bytes] = None) -> ValueError:
  """A one-line error naming the first byte of `path` (or of its `data`) that is not UTF-8."""
  decoder = codecs.getincrementaldecoder("utf-8")()
  offset, line = 0, 1
  chunks = [data] if data is not None else _chunks(path)
  for chunk in chunks:
    try:
      decoder.decode(chunk)
    except UnicodeDecodeError as e:
      bad = offset + max(e.start - (len(e.object) - len(chunk)), 0)
      line += chunk[: max(bad - offset, 0)].count(b"\n")
      return ValueError(
        f"{path} is not UTF-8 text: byte {bad} (line {line}) is "
        f"{chunk[bad - offset : bad - offset + 1]!r}; save it as UTF-8, or point "
        "config.data.path at text files."
      )
    offset += len(chunk)
    line += chunk.count(b"\n")
  return ValueError(f"{path} is not UTF-8 text; save it as UTF-8.")


def _chunks(path, size: int = 1 << 20):
  with open(path, "rb") as f:
    while chunk := f.read(size):
      yield chunk


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
    raise not_utf8_error(path, raw) from None
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
  return Corpus("text8", [train], [validation], [test], key=f"text8:{_file_key([path])}")


# ---------------------------------------------------------------- local files


def _file_key(files: Sequence) -> str:
  # Path, size and mtime: a changed file invalidates caches built from it.
  stats = [
    (
      str(pathlib.Path(f).resolve()),
      pathlib.Path(f).stat().st_size,
      pathlib.Path(f).stat().st_mtime_ns,
    )
    for f in files
  ]
  return json.dumps(stats)


def list_files(path) -> list:
  """The document files at `path`: itself, or every .txt/.jsonl below it, sorted."""
  path = pathlib.Path(path)
  if path.is_file():
    return [path]
  if not path.is_dir():
    raise FileNotFoundError(f"Corpus path {str(path)!r} does not exist.")
  files = sorted(
    p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES
  )
  if not files:
    raise ValueError(f"Folder {path} holds no {'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files.")
  return files


class Example(NamedTuple):
  """A conditional example: the response is generated given the prompt."""

  prompt: str
  response: str
  where: str  # "file:line", for error messages.


def _string_field(record, name: str, where: str, key: str) -> str:
  if not isinstance(record, dict) or not isinstance(record.get(name), str):
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{where}: no string field {name!r} (has {keys}); set config.data.{key}.")
  return record[name]


def _read_documents(
  path: pathlib.Path, text_field: str, pair_fields: Optional[tuple] = None
) -> Iterator:
  """Documents of one file: non-blank lines, or a text field of each JSON line.

  With pair_fields = (prompt field, response field): an Example of each JSON line.
  """
  is_jsonl = path.suffix in JSONL_SUFFIXES
  if pair_fields and not is_jsonl:
    raise ValueError(
      f"{path}: conditional data is JSONL ({'/'.join(JSONL_SUFFIXES)} files with "
      f"{pair_fields[0]!r} and {pair_fields[1]!r} fields per line), not {path.suffix!r}."
    )
  try:
    yield from _read_lines(path, text_field, pair_fields, is_jsonl)
  except UnicodeDecodeError:
    raise not_utf8_error(path) from None


def _read_lines(path: pathlib.Path, text_field: str, pair_fields: Optional[tuple], is_jsonl: bool):
  # newline="\n" splits lines exactly as _count_documents does on bytes.
  with open(path, encoding="utf-8", newline="\n") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip(_ASCII_SPACE):
        continue
      if not is_jsonl:
        yield line.rstrip("\r\n")
        continue
      where = f"{path}:{line_no}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}).") from None
      if pair_fields:
        prompt, response = (
          _string_field(record, name, where, key)
          for name, key in zip(pair_fields, ("prompt_field", "response_field"))
        )
        yield Example(prompt, response, where)
      else:
        yield _string_field(record, text_field, where, "text_field")


def _count_documents(path: pathlib.Path) -> int:
  with open(path, "rb") as f:
    return sum(1 for line in f if line.strip())


class Documents:
  """Documents [start, stop) of a list of files, read lazily on each iteration.

  With pair_fields = (prompt field, response field) the documents are Examples.
  """

  def __init__(
    self,
    files: Sequence,
    text_field: str = "text",
    start: int = 0,
    stop: Optional[int] = None,
    counts: Optional[Sequence[int]] = None,
    pair_fields: Optional[tuple] = None,
  ):
    self.files = [pathlib.Path(f) for f in files]
    self.text_field, self.pair_fields = text_field, pair_fields
    self.counts = list(counts) if counts is not None else [_count_documents(f) for f in self.files]
    total = sum(self.counts)
    self.start, self.stop = start, total if stop is None else stop
    if not 0 <= self.start <= self.stop <= total:
      raise ValueError(f"Document range [{start}, {stop}) is outside [0, {total}].")

  def __len__(self) -> int:
    return self.stop - self.start

  def split(self, at: int) -> tuple:
    """(documents [0, at), documents [at, len)) of this range."""
    mid = self.start + at
    return (
      Documents(self.files, self.text_field, self.start, mid, self.counts, self.pair_fields),
      Documents(self.files, self.text_field, mid, self.stop, self.counts, self.pair_fields),
    )

  def __iter__(self) -> Iterator:
    first = 0  # Index of the file's first document.
    for path, count in zip(self.files, self.counts):
      if first + count > self.start and first < self.stop:
        for i, doc in enumerate(_read_documents(path, self.text_field, self.pair_fields), first):
          if i >= self.stop:
            break
          if i >= self.start:
            yield doc
      first += count

  def texts(self) -> Iterable[str]:
    """The text of every document, re-iterable; an Example gives its prompt, then its response."""
    return _Texts(self)

  def key(self) -> str:
    fields = self.pair_fields or self.text_field
    return f"{_file_key(self.files)}:{fields}:{self.start}:{self.stop}"


class _Texts:
  """Documents' texts (prompts and responses of Examples), e.g. to train a tokenizer on."""

  def __init__(self, documents: Documents):
    self.documents = documents

  def __iter__(self) -> Iterator[str]:
    for doc in self.documents:
      if isinstance(doc, Example):
        yield doc.prompt
        yield doc.response
      else:
        yield doc


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
    train = Documents(list_files(path / "train"), text_field, pair_fields=pair_fields)
    validation = Documents(list_files(held_out[0]), text_field, pair_fields=pair_fields)
  else:
    docs = Documents(list_files(path), text_field, pair_fields=pair_fields)
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
