"""Tokenized corpora: documents -> one flat token array with document offsets, cached on disk.

`tokenize` ends each document with EOS (when the tokenizer has one);
`tokenize_examples` builds conditional prompt/response rows. A cache file in
the workdir (named by a fingerprint of the corpus and the tokenizer) is
memory-mapped on reuse, so a resumed run does not tokenize again.
"""

import hashlib
import json
import os
import pathlib
import tempfile
import warnings
from typing import Iterable, Iterator, Optional

import numpy as np

from md4jax.data import documents

# Documents are encoded this many at a time (BPE encodes a batch in parallel).
_ENCODE_BATCH = 1024
# Char/byte documents longer than this are encoded in slices to bound memory (text8 is one 90M doc).
_ENCODE_SLICE = 1 << 22


class TokenizedDocs:
  """Documents as one flat token array, each followed by EOS (if the tokenizer has one).

  Document i is tokens[offsets[i]:offsets[i + 1]]. A cached instance memory-maps
  its file and pickles as its path, so grain workers do not copy the tokens.
  Conditional examples also have prompt_lengths [num_docs] (the first tokens of
  each, never editable) and num_truncated (responses cut to fit a row).
  """

  def __init__(
    self,
    tokens: np.ndarray,
    offsets: np.ndarray,
    path: Optional[str] = None,
    prompt_lengths: Optional[np.ndarray] = None,
    num_truncated: int = 0,
  ):
    self.tokens, self.offsets, self.path = tokens, np.asarray(offsets, np.int64), path
    self.prompt_lengths, self.num_truncated = prompt_lengths, num_truncated

  @classmethod
  def open(cls, path: str) -> "TokenizedDocs":
    meta = json.loads(pathlib.Path(path + ".json").read_text())
    tokens = np.memmap(path + ".tokens", dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],))
    prompts = pathlib.Path(path + ".prompts.npy")
    return cls(
      tokens,
      np.load(path + ".offsets.npy"),
      path,
      np.load(prompts) if prompts.is_file() else None,
      meta["num_truncated"],
    )

  @property
  def num_docs(self) -> int:
    return len(self.offsets) - 1

  @property
  def num_tokens(self) -> int:
    return int(self.offsets[-1])

  def __getstate__(self):
    return {"path": self.path} if self.path else self.__dict__

  def __setstate__(self, state):
    if "tokens" in state:
      self.__dict__.update(state)
    else:
      self.__dict__.update(TokenizedDocs.open(state["path"]).__dict__)


def _encode_all(documents: Iterable[str], tok) -> Iterator[np.ndarray]:
  """Token ids of each non-empty document, EOS appended."""
  eos = [] if tok.eos_id is None else [tok.eos_id]

  def finish(ids_list):
    for ids in ids_list:
      if len(ids):
        yield np.concatenate([ids, np.asarray(eos, ids.dtype)])

  pending = []
  for doc in documents:
    if hasattr(tok, "encode_batch"):
      pending.append(doc)
      if len(pending) == _ENCODE_BATCH:
        yield from finish(tok.encode_batch(pending))
        pending = []
    elif len(doc) > _ENCODE_SLICE:
      # Characters and bytes encode independently, so slicing changes nothing.
      parts = [tok.encode(doc[i : i + _ENCODE_SLICE]) for i in range(0, len(doc), _ENCODE_SLICE)]
      yield from finish([np.concatenate(parts)])
    else:
      yield from finish([tok.encode(doc)])
  if pending:
    yield from finish(tok.encode_batch(pending))


def _write_file(path: str, write):
  """Calls write(binary file) on a temporary file, then renames it to `path`."""
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
  with os.fdopen(fd, "wb") as f:
    write(f)
  os.replace(tmp, path)


def fingerprint(tok, corpus_key: str) -> str:
  """A short hash of the tokenizer and the data it encodes (names caches)."""
  spec = json.dumps(tok.to_json(), sort_keys=True)
  return hashlib.sha256(f"{corpus_key}\n{spec}".encode()).hexdigest()[:16]


def tokenize(documents: Iterable[str], tok, *, cache: Optional[str] = None) -> TokenizedDocs:
  """Encodes `documents`; with `cache` (a path prefix), reuses or writes files there.

  The cache is <cache>.tokens (raw ids, uint16 when they fit), <cache>.offsets.npy
  and <cache>.json, written last so that a half-written cache is never read.
  Tokens are streamed to disk, so the corpus need not fit in memory.
  """
  return _store(_encode_all(documents, tok), tok, cache)


def tokenize_examples(
  examples: Iterable[documents.Example], tok, *, seq_len: int, cache: Optional[str] = None
) -> TokenizedDocs:
  """Conditional examples as documents [prompt][response][EOS], cut to seq_len tokens.

  The result's prompt_lengths say where each response starts. A prompt that
  leaves no room for a response token (a sequence longer than the model's)
  raises, naming its file:line; longer responses are cut, counted in
  num_truncated and reported in one warning. Cached like `tokenize`.
  """
  eos = np.asarray([] if tok.eos_id is None else [tok.eos_id], np.int64)
  prompt_lengths, truncated = [], []

  def encode():
    for example in examples:
      prompt = np.asarray(tok.encode(example.prompt), np.int64)
      response = np.concatenate([np.asarray(tok.encode(example.response), np.int64), eos])
      if len(prompt) >= seq_len:
        raise ValueError(
          f"{example.where}: the prompt is {len(prompt)} tokens, but a row holds "
          f"data.seq_len={seq_len} (the model's sequence length) and needs room for at least "
          "one response token; shorten the prompt or raise data.seq_len."
        )
      if not len(response):
        raise ValueError(
          f"{example.where}: the response is empty and the tokenizer has no EOS, "
          "so the example has nothing to predict."
        )
      room = seq_len - len(prompt)
      prompt_lengths.append(len(prompt))
      truncated.append(len(response) > room)
      yield np.concatenate([prompt, response[:room]])

  extras = lambda: (np.asarray(prompt_lengths, np.int64), int(sum(truncated)))
  result = _store(encode(), tok, cache, extras)
  if truncated and result.num_truncated:  # Only when encoded now, not read from the cache.
    warnings.warn(
      f"{result.num_truncated} of {len(truncated)} conditional responses were cut to "
      f"fit data.seq_len={seq_len}.",
      stacklevel=2,
    )
  return result


def _store(encoded: Iterable[np.ndarray], tok, cache: Optional[str], extras=None) -> TokenizedDocs:
  """TokenizedDocs of the encoded documents, cached at `cache` (see `tokenize`).

  extras(), called once `encoded` is consumed, gives conditional examples'
  (prompt_lengths, num_truncated), stored as <cache>.prompts.npy and in <cache>.json.
  """
  dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
  if cache is None:
    docs = list(encoded)
    offsets = np.cumsum([0] + [len(d) for d in docs])
    tokens = np.concatenate(docs).astype(dtype) if docs else np.zeros(0, dtype)
    result = TokenizedDocs(tokens, offsets, None, *(extras() if extras else (None, 0)))
  elif os.path.exists(cache + ".json"):
    return TokenizedDocs.open(cache)
  else:
    directory = pathlib.Path(cache).parent
    directory.mkdir(parents=True, exist_ok=True)
    lengths = []
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
      with os.fdopen(fd, "wb") as f:
        for ids in encoded:
          f.write(ids.astype(dtype).tobytes())
          lengths.append(len(ids))
    except BaseException:
      os.remove(tmp)  # A bad document (e.g. a prompt too long) leaves no stray file.
      raise
    offsets = np.cumsum([0] + lengths).astype(np.int64)
    # Unique temporary names, then renames: processes sharing a workdir may race harmlessly.
    os.replace(tmp, cache + ".tokens")
    _write_file(cache + ".offsets.npy", lambda f: np.save(f, offsets))
    meta = {
      "dtype": np.dtype(dtype).name,
      "num_tokens": int(offsets[-1]),
      "num_docs": len(lengths),
      "num_truncated": 0,
    }
    if extras:
      prompt_lengths, meta["num_truncated"] = extras()
      _write_file(cache + ".prompts.npy", lambda f: np.save(f, prompt_lengths))
    _write_file(cache + ".json", lambda f: f.write(json.dumps(meta).encode()))
    result = TokenizedDocs.open(cache)
  if result.num_tokens == 0:
    raise ValueError("The documents hold no tokens (empty split or empty documents).")
  return result
