"""Local document files, read lazily: one document per non-empty line of a .txt file, or per
JSON line of a .jsonl file (a text field, or a prompt/response pair: an `Example`).

`Documents` is a range of the documents of a list of files, re-iterable and split without
reading them; md4jax.data.corpora builds the corpora's splits from it.
"""

import codecs
import json
import pathlib
from typing import Iterable, Iterator, NamedTuple, Optional, Sequence

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
# Lines of only these characters hold no document (bytes.strip()'s set, for counting).
_ASCII_SPACE = " \t\n\r\x0b\x0c"


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


def file_key(files: Sequence) -> str:
  """The files' identity for caches: path, size and mtime, so a changed file invalidates them."""
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
    return f"{file_key(self.files)}:{fields}:{self.start}:{self.stop}"


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
