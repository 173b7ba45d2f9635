"""Token pipeline: documents -> token ids -> fixed-length rows -> batches (grain).

Every batch is a dict of NumPy arrays of shape [B, L]:
  tokens       int32 token ids; 0 at padding.
  segment_ids  int32 1, 2, ... for the document pieces of a row; 0 at padding.
               None in "concat" training batches, whose rows are each one whole
               segment: the model then builds no attention mask.
  positions    int32 position within the segment; restarts at 0 per segment.
               None where segment_ids is (positions 0 .. L-1).
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
import pathlib
from typing import Iterator, Optional

import grain
import jax
import numpy as np

from md4jax.data import corpora
from md4jax.data import tokenizer as tokenizer_lib

# Re-exported: the pipeline's callers build TokenizedDocs and call these directly.
from md4jax.data.token_cache import TokenizedDocs, fingerprint, tokenize, tokenize_examples

PACKINGS = ("concat", "documents")


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
  return (
    np.asarray(row_splits, np.int64),
    np.asarray(starts, np.int64),
    np.asarray(lengths, np.int64),
  )


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
    raise ValueError(
      f"A conditional example has {lengths.max()} tokens, more than seq_len="
      f"{seq_len}; tokenize_examples with this seq_len."
    )
  return np.arange(docs.num_docs + 1), docs.offsets[:-1], lengths, docs.prompt_lengths


def packed_row(tokens: np.ndarray, seq_len: int, starts, lengths, prompt_lengths=None) -> dict:
  """One row from (start, length) pieces of `tokens`, each its own segment, then padding.

  A piece's first prompt_lengths[i] tokens (none by default) are not editable.
  """
  row = {k: np.zeros(seq_len, np.int32) for k in ("tokens", "segment_ids", "positions")}
  row["editable"] = np.zeros(seq_len, bool)
  prompt_lengths = np.zeros(len(starts), np.int64) if prompt_lengths is None else prompt_lengths
  at = 0
  for segment, (start, length, prompt) in enumerate(zip(starts, lengths, prompt_lengths), 1):
    row["tokens"][at : at + length] = tokens[start : start + length]
    row["segment_ids"][at : at + length] = segment
    row["positions"][at : at + length] = np.arange(length)
    row["editable"][at + prompt : at + length] = True
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
    return packed_row(
      self.docs.tokens, self.seq_len, self.starts[a:b], self.lengths[a:b], self.prompts[a:b]
    )


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
    start = window * self.seq_len + offset
    # One whole segment: no segment ids, so the train step builds no attention mask (one that
    # allows everything still costs time: docs/performance.md). Evaluation windows keep them:
    # the split's last one is padded.
    return {
      "tokens": np.asarray(self.docs.tokens[start : start + self.seq_len], np.int32),
      "segment_ids": None,
      "positions": None,
      "editable": np.ones(self.seq_len, bool),
    }


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
    raise ValueError(
      f"Conditional examples are one row each (packing='documents'); "
      f"packing={packing!r} would cut windows across them."
    )
  if seq_len < 1 or batch_size < 1:
    raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive.")


def train_dataset(
  docs: TokenizedDocs,
  *,
  seq_len: int,
  batch_size: int,
  seed: int,
  packing: str = "concat",
  shard_index: Optional[int] = None,
  shard_count: Optional[int] = None,
) -> grain.MapDataset:
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
  # Global batch i is rows [i·B, (i+1)·B) whatever the process count: process p holds
  # its p-th block of batch_size = B / count rows.
  return ds.batch(batch_size, drop_remainder=True)[index::count]


class TrainIterator:
  """Infinite iterator over a train_dataset; its state is {"next_batch_index": int}.

  Restoring a state rebuilds the grain pipeline at that batch, so a resumed
  run yields exactly the batches the uninterrupted one would have, whatever
  worker_count either used.
  """

  def __init__(
    self,
    dataset: grain.MapDataset,
    *,
    worker_count: int = 0,
    prefetch: int = 2,
    num_threads: int = 1,
  ):
    self.dataset, self.worker_count = dataset, worker_count
    self.prefetch, self.num_threads = prefetch, num_threads
    self.next_batch_index, self._iterator = 0, None

  def _open(self):
    ds = self.dataset[self.next_batch_index :].to_iter_dataset(
      grain.ReadOptions(num_threads=self.num_threads, prefetch_buffer_size=self.prefetch)
    )
    if self.worker_count > 0:
      ds = ds.mp_prefetch(
        grain.MultiprocessingOptions(
          num_workers=self.worker_count, per_worker_buffer_size=self.prefetch
        )
      )
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
  its document packing ("documents"), in order. Global batch k holds rows
  [k·B, (k+1)·B) with B = batch_size · count, and process p its p-th block of
  batch_size rows, so the global batches are the same on any number of
  processes; every process yields len(self) batches, the last ones filled with
  all-padding rows (segment_ids 0), so collectives line up across hosts.
  """

  def __init__(
    self,
    docs: TokenizedDocs,
    *,
    seq_len: int,
    batch_size: int,
    packing: str = "concat",
    shard_index: Optional[int] = None,
    shard_count: Optional[int] = None,
  ):
    _check(docs, seq_len, batch_size, packing)
    self.shard_index, self.shard_count = _shard(shard_index, shard_count)
    self.docs, self.seq_len, self.batch_size = docs, seq_len, batch_size
    if packing == "concat":
      n = docs.num_tokens
      starts = np.arange(0, n, seq_len)
      self._pieces = [([s], [min(seq_len, n - s)]) for s in starts.tolist()]
    else:
      splits, starts, lengths, prompts = document_rows(docs, seq_len)
      self._pieces = [
        (starts[a:b], lengths[a:b], prompts[a:b]) for a, b in zip(splits[:-1], splits[1:])
      ]
    self.num_rows = len(self._pieces)
    self.num_batches = -(-self.num_rows // (batch_size * self.shard_count))

  def __len__(self) -> int:
    return self.num_batches

  def __iter__(self) -> Iterator[dict]:
    empty = ([], [])
    for b in range(self.num_batches):
      first = (b * self.shard_count + self.shard_index) * self.batch_size
      ids = range(first, min(first + self.batch_size, self.num_rows))
      rows = [packed_row(self.docs.tokens, self.seq_len, *self._pieces[i]) for i in ids]
      rows += [packed_row(self.docs.tokens, self.seq_len, *empty)] * (self.batch_size - len(rows))
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

  def train_iterator(
    self,
    *,
    batch_size: int,
    seed: int,
    worker_count: int = 0,
    shard_index: Optional[int] = None,
    shard_count: Optional[int] = None,
  ) -> TrainIterator:
    """Per-process batches of `batch_size` rows (the global batch / process count)."""
    ds = train_dataset(
      self.train,
      seq_len=self.seq_len,
      batch_size=batch_size,
      seed=seed,
      packing=self.packing,
      shard_index=shard_index,
      shard_count=shard_count,
    )
    return TrainIterator(ds, worker_count=worker_count)

  def eval_batches(
    self,
    *,
    batch_size: int,
    split: str = "validation",
    shard_index: Optional[int] = None,
    shard_count: Optional[int] = None,
  ) -> EvalBatches:
    docs = {"validation": self.validation, "test": self.test}.get(split)
    if docs is None:
      valid = "validation, test" if self.test is not None else "validation"
      raise ValueError(f"No {split!r} split in this data; valid: {valid}.")
    return EvalBatches(
      docs,
      seq_len=self.seq_len,
      batch_size=batch_size,
      packing=self.packing,
      shard_index=shard_index,
      shard_count=shard_count,
    )


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
  return tokenizer_lib.make_tokenizer(
    kind,
    train_text_iter=train_text,
    path=path or None,
    vocab_size=data.bpe_vocab_size,
    workdir=workdir,
  )


def load_data(config, workdir: Optional[str] = None) -> Data:
  """Reads, tokenizes (cached under workdir/data_cache) and describes config.data's corpus.

  Reads config.data.{dataset, path, seq_len, tokenizer, tokenizer_path,
  bpe_vocab_size, packing, text_field, prompt_field, response_field}. The
  tokenizer is saved in workdir and reused on resume; lm1b/owt use
  bert-base-uncased/gpt2 unless tokenizer_path names a local tokenizer.json.
  Conditional data is one example per row whatever data.packing says.
  """
  data = config.data
  corpus = corpora.load_corpus(
    data.dataset,
    data.path,
    text_field=data.text_field,
    prompt_field=data.prompt_field,
    response_field=data.response_field,
  )
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

  return Data(
    tok,
    encode("train", corpus.train),
    encode("validation", corpus.validation),
    encode("test", corpus.test),
    seq_len=data.seq_len,
    packing="documents" if conditional else data.packing,
  )
