"""Token pipeline: documents -> token ids -> fixed-length rows -> batches (grain).

Every batch is a dict of NumPy arrays of shape [B, L]:
  tokens       int32 token ids; 0 at padding.
  segment_ids  int32 1, 2, ... for the document pieces of a row; 0 at padding.
  positions    int32 position within the segment; restarts at 0 per segment.
  editable     bool: the positions the model predicts (masked and scored). For
               text, segment_ids > 0; for conditional examples, the response
               (and its EOS) only. Padding and prompts are never editable.

Packing:
  "concat"     the documents, each ended by EOS, as one stream cut into windows
               of L tokens at random offsets (MD4's text8 style); one segment
               per row, so attention crosses document boundaries.
  "documents"  documents packed whole into rows (greedily, in order); one longer
               than L is cut into L-token pieces. Each piece is its own segment,
               so with `model.Transformer(..., segment_ids, positions)` no token
               attends across documents.
Conditional examples (tokenize_examples) are one row each, [prompt][response]
[EOS] then padding, used with "documents" packing; prompt and response are one
segment, so the denoiser reads the prompt.

Training example i of the global stream is a pure function of (seed, i): an
epoch-wise grain shuffle, then per-example offsets drawn from (seed, epoch,
window). Process p of P takes examples p, p + P, ...; so global batch b is the
same set of examples whatever P is, and the iterator state is one integer.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile
import warnings
from typing import Iterable, Iterator, Optional

import grain
import jax
import numpy as np

from md4jax import corpora
from md4jax import tokenizer as tokenizer_lib

PACKINGS = ("concat", "documents")
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

  def __init__(self, tokens: np.ndarray, offsets: np.ndarray, path: Optional[str] = None,
               prompt_lengths: Optional[np.ndarray] = None, num_truncated: int = 0):
    self.tokens, self.offsets, self.path = tokens, np.asarray(offsets, np.int64), path
    self.prompt_lengths, self.num_truncated = prompt_lengths, num_truncated

  @classmethod
  def open(cls, path: str) -> "TokenizedDocs":
    meta = json.loads(pathlib.Path(path + ".json").read_text())
    tokens = np.memmap(path + ".tokens", dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],))
    prompts = pathlib.Path(path + ".prompts.npy")
    return cls(tokens, np.load(path + ".offsets.npy"), path,
               np.load(prompts) if prompts.is_file() else None, meta.get("num_truncated", 0))

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
      parts = [tok.encode(doc[i:i + _ENCODE_SLICE]) for i in range(0, len(doc), _ENCODE_SLICE)]
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


def tokenize_examples(examples: Iterable[corpora.Example], tok, *, seq_len: int,
                      cache: Optional[str] = None) -> TokenizedDocs:
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
            "one response token; shorten the prompt or raise data.seq_len.")
      if not len(response):
        raise ValueError(f"{example.where}: the response is empty and the tokenizer has no EOS, "
                         "so the example has nothing to predict.")
      room = seq_len - len(prompt)
      prompt_lengths.append(len(prompt))
      truncated.append(len(response) > room)
      yield np.concatenate([prompt, response[:room]])

  extras = lambda: (np.asarray(prompt_lengths, np.int64), int(sum(truncated)))
  result = _store(encode(), tok, cache, extras)
  if truncated and result.num_truncated:  # Only when encoded now, not read from the cache.
    warnings.warn(f"{result.num_truncated} of {len(truncated)} conditional responses were cut to "
                  f"fit data.seq_len={seq_len}.")
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
    meta = {"dtype": np.dtype(dtype).name, "num_tokens": int(offsets[-1]), "num_docs": len(lengths)}
    if extras:
      prompt_lengths, meta["num_truncated"] = extras()
      _write_file(cache + ".prompts.npy", lambda f: np.save(f, prompt_lengths))
    _write_file(cache + ".json", lambda f: f.write(json.dumps(meta).encode()))
    result = TokenizedDocs.open(cache)
  if result.num_tokens == 0:
    raise ValueError("The documents hold no tokens (empty split or empty documents).")
  return result


def pack_documents(offsets: np.ndarray, seq_len: int) -> tuple:
  """Greedy packing of documents, in order, into rows of `seq_len` tokens.

  A document is cut into seq_len-token pieces plus a shorter tail; full pieces
  are rows of their own, and a tail goes into the open row if it fits, else
  starts a new one. Returns (row_splits [R + 1], piece_starts [P], piece_lengths
  [P]): row r holds pieces row_splits[r]:row_splits[r + 1], in order.
  """
  row_splits, starts, lengths = [0], [], []
  open_starts, open_lengths, used = [], [], 0
  for begin, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
    n_full = (end - begin) // seq_len
    for j in range(n_full):
      starts.append(begin + j * seq_len)
      lengths.append(seq_len)
      row_splits.append(len(starts))
    tail = (end - begin) - n_full * seq_len
    if not tail:
      continue
    if used + tail > seq_len:
      starts.extend(open_starts)
      lengths.extend(open_lengths)
      row_splits.append(len(starts))
      open_starts, open_lengths, used = [], [], 0
    open_starts.append(end - tail)
    open_lengths.append(tail)
    used += tail
  if open_starts:
    starts.extend(open_starts)
    lengths.extend(open_lengths)
    row_splits.append(len(starts))
  return (np.asarray(row_splits, np.int64), np.asarray(starts, np.int64),
          np.asarray(lengths, np.int64))


def document_rows(docs: TokenizedDocs, seq_len: int) -> tuple:
  """(row_splits, piece_starts, piece_lengths, piece_prompt_lengths) of "documents" packing.

  Plain documents are packed by pack_documents (no prompts); conditional
  examples (docs.prompt_lengths set) are one row each.
  """
  if docs.prompt_lengths is None:
    splits, starts, lengths = pack_documents(docs.offsets, seq_len)
    return splits, starts, lengths, np.zeros_like(lengths)
  lengths = np.diff(docs.offsets)
  if docs.num_docs and lengths.max() > seq_len:
    raise ValueError(f"A conditional example has {lengths.max()} tokens, more than seq_len="
                     f"{seq_len}; tokenize_examples with this seq_len.")
  return np.arange(docs.num_docs + 1), docs.offsets[:-1], lengths, docs.prompt_lengths


def _row(tokens: np.ndarray, seq_len: int, starts, lengths, prompt_lengths=None) -> dict:
  """One row from (start, length) pieces of `tokens`, each its own segment, then padding.

  A piece's first prompt_lengths[i] tokens (none by default) are not editable.
  """
  row = {k: np.zeros(seq_len, np.int32) for k in ("tokens", "segment_ids", "positions")}
  row["editable"] = np.zeros(seq_len, bool)
  prompt_lengths = np.zeros(len(starts), np.int64) if prompt_lengths is None else prompt_lengths
  at = 0
  for segment, (start, length, prompt) in enumerate(zip(starts, lengths, prompt_lengths), 1):
    row["tokens"][at:at + length] = tokens[start:start + length]
    row["segment_ids"][at:at + length] = segment
    row["positions"][at:at + length] = np.arange(length)
    row["editable"][at + prompt:at + length] = True
    at += length
  return row


class _PackedRows:
  """Row r of the document packing (a grain map)."""

  def __init__(self, docs: TokenizedDocs, seq_len: int):
    self.docs, self.seq_len = docs, seq_len
    self.row_splits, self.starts, self.lengths, self.prompts = document_rows(docs, seq_len)
    self.num_rows = len(self.row_splits) - 1

  def __call__(self, row: int) -> dict:
    a, b = self.row_splits[row], self.row_splits[row + 1]
    return _row(self.docs.tokens, self.seq_len, self.starts[a:b], self.lengths[a:b],
                self.prompts[a:b])


class _RandomWindows:
  """Window k of the token stream, shifted by an offset in [0, seq_len) per (seed, epoch, k).

  Window starts k * L + offset are distinct, so an epoch's examples (and so
  different processes' examples) never start at the same token.
  """

  def __init__(self, docs: TokenizedDocs, seq_len: int, seed: int):
    n = docs.num_tokens
    if n < seq_len:
      raise ValueError(f"The training split has {n} tokens, fewer than seq_len={seq_len}.")
    self.docs, self.seq_len, self.seed = docs, seq_len, seed
    self.num_windows = max(1, (n - seq_len + 1) // seq_len)
    self.max_offset = min(seq_len, n - seq_len - (self.num_windows - 1) * seq_len + 1)

  def __call__(self, index: int, window: int) -> dict:
    epoch = index // self.num_windows
    offset = np.random.default_rng((self.seed, epoch, window)).integers(self.max_offset)
    return _row(self.docs.tokens, self.seq_len, [window * self.seq_len + offset], [self.seq_len])


def _shard(shard_index: Optional[int], shard_count: Optional[int]) -> tuple:
  index = jax.process_index() if shard_index is None else shard_index
  count = jax.process_count() if shard_count is None else shard_count
  if not 0 <= index < count:
    raise ValueError(f"shard_index={index} is not in [0, shard_count={count}).")
  return index, count


def _check(docs: TokenizedDocs, seq_len: int, batch_size: int, packing: str):
  if packing not in PACKINGS:
    raise ValueError(f"Unknown packing {packing!r}; valid: {', '.join(PACKINGS)}.")
  if docs.prompt_lengths is not None and packing != "documents":
    raise ValueError(f"Conditional examples are one row each (packing='documents'); "
                     f"packing={packing!r} would cut windows across them.")
  if seq_len < 1 or batch_size < 1:
    raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive.")


def train_dataset(docs: TokenizedDocs, *, seq_len: int, batch_size: int, seed: int,
                  packing: str = "concat", shard_index: Optional[int] = None,
                  shard_count: Optional[int] = None) -> grain.MapDataset:
  """Infinite grain.MapDataset of this process's batches (batch_size rows each)."""
  _check(docs, seq_len, batch_size, packing)
  if not 0 <= seed < 2**32:
    raise ValueError(f"The data seed must be in [0, 2**32), got {seed}.")
  index, count = _shard(shard_index, shard_count)
  if packing == "concat":
    windows = _RandomWindows(docs, seq_len, seed)
    ds = grain.MapDataset.range(windows.num_windows).shuffle(seed=seed).repeat(None)
    ds = ds.map_with_index(windows)
  else:
    rows = _PackedRows(docs, seq_len)
    ds = grain.MapDataset.range(rows.num_rows).shuffle(seed=seed).repeat(None).map(rows)
  return ds[index::count].batch(batch_size, drop_remainder=True)


class TrainIterator:
  """Infinite iterator over a train_dataset; its state is {"next_batch_index": int}.

  Restoring a state rebuilds the grain pipeline at that batch, so a resumed
  run yields exactly the batches the uninterrupted one would have, whatever
  worker_count either used.
  """

  def __init__(self, dataset: grain.MapDataset, *, worker_count: int = 0, prefetch: int = 2,
               num_threads: int = 1):
    self.dataset, self.worker_count = dataset, worker_count
    self.prefetch, self.num_threads = prefetch, num_threads
    self.next_batch_index, self._iterator = 0, None

  def _open(self):
    ds = self.dataset[self.next_batch_index:].to_iter_dataset(grain.ReadOptions(
        num_threads=self.num_threads, prefetch_buffer_size=self.prefetch))
    if self.worker_count > 0:
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(
          num_workers=self.worker_count, per_worker_buffer_size=self.prefetch))
    self._iterator = iter(ds)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self._iterator is None:
      self._open()  # Lazily: a restore right after construction starts no workers twice.
    batch = next(self._iterator)
    self.next_batch_index += 1
    return batch

  def get_state(self) -> dict:
    return {"next_batch_index": self.next_batch_index}

  def set_state(self, state: dict):
    self.close()
    self.next_batch_index = int(state["next_batch_index"])

  def close(self):
    if self._iterator is not None and hasattr(self._iterator, "close"):
      self._iterator.close()
    self._iterator = None


class EvalBatches:
  """Finite, re-iterable evaluation batches: every token of the split in exactly one row.

  Rows are the split's non-overlapping windows ("concat", last one padded) or
  its document packing ("documents"), in order. Process p takes rows p, p + P,
  ...; every process yields len(self) batches, the last ones filled with
  all-padding rows (segment_ids 0), so collectives line up across hosts.
  """

  def __init__(self, docs: TokenizedDocs, *, seq_len: int, batch_size: int,
               packing: str = "concat", shard_index: Optional[int] = None,
               shard_count: Optional[int] = None):
    _check(docs, seq_len, batch_size, packing)
    index, count = _shard(shard_index, shard_count)
    self.docs, self.seq_len, self.batch_size = docs, seq_len, batch_size
    if packing == "concat":
      n = docs.num_tokens
      starts = np.arange(0, n, seq_len)
      self._pieces = [([s], [min(seq_len, n - s)]) for s in starts.tolist()]
    else:
      splits, starts, lengths, prompts = document_rows(docs, seq_len)
      self._pieces = [(starts[a:b], lengths[a:b], prompts[a:b])
                      for a, b in zip(splits[:-1], splits[1:])]
    self.num_rows = len(self._pieces)
    self._mine = list(range(index, self.num_rows, count))
    rows_per_shard = -(-self.num_rows // count)
    self.num_batches = -(-rows_per_shard // batch_size)

  def __len__(self) -> int:
    return self.num_batches

  def __iter__(self) -> Iterator[dict]:
    empty = ([], [])
    for b in range(self.num_batches):
      ids = self._mine[b * self.batch_size:(b + 1) * self.batch_size]
      rows = [_row(self.docs.tokens, self.seq_len, *self._pieces[i]) for i in ids]
      rows += [_row(self.docs.tokens, self.seq_len, *empty)] * (self.batch_size - len(rows))
      yield {k: np.stack([r[k] for r in rows]) for k in rows[0]}


@dataclasses.dataclass
class Data:
  """A tokenized corpus and how it is cut into rows; see load_data."""
  tokenizer: object
  train: TokenizedDocs
  validation: TokenizedDocs
  test: Optional[TokenizedDocs]
  seq_len: int
  packing: str

  def train_iterator(self, *, batch_size: int, seed: int, worker_count: int = 0,
                     shard_index: Optional[int] = None,
                     shard_count: Optional[int] = None) -> TrainIterator:
    """Per-process batches of `batch_size` rows (the global batch / process count)."""
    ds = train_dataset(self.train, seq_len=self.seq_len, batch_size=batch_size, seed=seed,
                       packing=self.packing, shard_index=shard_index, shard_count=shard_count)
    return TrainIterator(ds, worker_count=worker_count)

  def eval_batches(self, *, batch_size: int, split: str = "validation",
                   shard_index: Optional[int] = None,
                   shard_count: Optional[int] = None) -> EvalBatches:
    docs = {"validation": self.validation, "test": self.test}.get(split)
    if docs is None:
      valid = "validation, test" if self.test is not None else "validation"
      raise ValueError(f"No {split!r} split in this data; valid: {valid}.")
    return EvalBatches(docs, seq_len=self.seq_len, batch_size=batch_size, packing=self.packing,
                       shard_index=shard_index, shard_count=shard_count)


# Default tokenizers of the MDLM corpora, fetched from the Hub when no local file is given.
PRETRAINED = {"lm1b": "bert-base-uncased", "owt": "gpt2"}


def _make_tokenizer(data, corpus: corpora.Corpus, workdir):
  # Conditional data trains its tokenizer on the training prompts and responses.
  train_text = corpus.train.texts() if data.dataset == "conditional" else corpus.train
  if data.dataset == "text8":
    return tokenizer_lib.make_tokenizer("text8", workdir=workdir)
  kind, path = data.tokenizer, data.tokenizer_path
  saved = workdir and (pathlib.Path(workdir) / tokenizer_lib.TOKENIZER_FILE).is_file()
  if data.dataset in PRETRAINED and kind == "bpe" and not path and not saved:
    tok = tokenizer_lib.BpeTokenizer.from_pretrained(PRETRAINED[data.dataset])
    if workdir:
      tok.save(workdir)
    return tok
  return tokenizer_lib.make_tokenizer(kind, train_text_iter=train_text, path=path or None,
                                      vocab_size=data.bpe_vocab_size, workdir=workdir)


def load_data(config, workdir: Optional[str] = None) -> Data:
  """Reads, tokenizes (cached under workdir/data_cache) and describes config.data's corpus.

  Reads config.data.{dataset, path, seq_len, tokenizer, tokenizer_path,
  bpe_vocab_size, packing, text_field, prompt_field, response_field}. The
  tokenizer is saved in workdir and reused on resume; lm1b/owt use
  bert-base-uncased/gpt2 unless tokenizer_path names a local tokenizer.json.
  Conditional data is one example per row whatever data.packing says.
  """
  data = config.data
  corpus = corpora.load_corpus(data.dataset, data.path, text_field=data.text_field,
                               prompt_field=data.prompt_field, response_field=data.response_field)
  tok = _make_tokenizer(data, corpus, workdir)
  conditional = data.dataset == "conditional"

  def encode(split: str, documents):
    if documents is None:
      return None
    cache = None
    if workdir:
      # Conditional examples are cut to seq_len when tokenized, so it names the cache too.
      key = fingerprint(tok, f"{corpus.key}:{split}" + (f":{data.seq_len}" if conditional else ""))
      cache = str(pathlib.Path(workdir) / "data_cache" / f"{corpus.name}-{split}-{key}")
    if conditional:
      return tokenize_examples(documents, tok, seq_len=data.seq_len, cache=cache)
    return tokenize(documents, tok, cache=cache)

  return Data(tok, encode("train", corpus.train), encode("validation", corpus.validation),
              encode("test", corpus.test), seq_len=data.seq_len,
              packing="documents" if conditional else data.packing)
