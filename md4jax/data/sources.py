"""The trainer's data sources: the generated Markov language, or a text corpus.

Both yield batches as dicts of [B, L] arrays: int32 `tokens`, `segment_ids`
(0 = padding; packed documents have distinct ids and attend only within
themselves) and `positions` (restart per document), and bool `editable`, the
positions that are masked and scored (never padding, nor a conditional
example's prompt). Where every row is one whole segment, or a whole row of
padding (which no other row reads), `segment_ids` and `positions` are None
(`dense_batch`): the model then builds no attention mask. Each
source has a training iterator whose checkpointable state is the next batch
index, so a resumed run sees exactly the batches it would have seen, and
finite evaluation batches. `Source` names what the rest of md4jax reads of one.
"""

import itertools
from typing import Iterable, Iterator, Optional, Protocol

import ml_collections
import numpy as np

from md4jax import rng
from md4jax.data import pipeline
from md4jax.diffusion import groundtruth


class Source(Protocol):
  """What training, evaluation and sampling read of a data source (MarkovSource, TextSource)."""

  # Exact entropy in bits per token where the data's law is known, else None.
  true_bits_per_token: Optional[float]

  def train_iterator(self) -> Iterator[dict]:
    """This process's training batches, from a checkpointable position."""
    ...

  def eval_batches(self, num_sequences: int, batch_size: int) -> Iterable[dict]:
    """This process's block of each held-out batch, enough for num_sequences rows."""
    ...

  def true_bits_per_token_of(self, tokens: np.ndarray) -> Optional[np.ndarray]:
    """−log2 p(x) / L of each row [B] under the true law, or None where it is unknown."""
    ...

  def text_lengths(
    self, tokens: np.ndarray, editable: np.ndarray
  ) -> Optional[tuple[int, Optional[int]]]:
    """(characters, UTF-8 bytes) the editable tokens of the rows [B, L] stand for, summed; None
    for tokens that are not text, bytes None where the tokenizer has no exact count."""
    ...

  def decode(self, tokens: np.ndarray) -> str:
    """The text of a row of ids."""
    ...

  def token_text(self, token: int) -> str:
    """The text of one id."""
    ...

  def encode(self, text: str) -> np.ndarray:
    """The ids of a text (a prompt)."""
    ...


def dense_batch(tokens: np.ndarray) -> dict:
  """A batch of unpadded, unpacked rows: one segment each, positions 0..L−1, all editable.

  segment_ids and positions are None: with them the model would build an attention mask
  that allows everything, a cost to the train step for nothing (docs/performance.md).
  """
  tokens = np.asarray(tokens, np.int32)
  return {
    "tokens": tokens,
    "segment_ids": None,
    "positions": None,
    "editable": np.ones(tokens.shape, bool),
  }


def has_segments(config: ml_collections.ConfigDict, training: bool) -> bool:
  """Whether config's training (else evaluation) batches carry segment_ids and positions: text
  packed by documents, and text evaluation windows (the split's last one is padded)."""
  if config.data.dataset == "markov":
    return False
  return config.data.packing == "documents" or not training


def pad_rows(batch: dict, missing: int) -> dict:
  """The batch and `missing` padding rows after it: zeros (segment 0, not editable); None stays."""
  return {
    k: None if v is None else np.pad(np.asarray(v), ((0, missing), (0, 0)))
    for k, v in batch.items()
  }


def _padded_batches(rows: np.ndarray, batch_size: int) -> list:
  """Rows in batches of batch_size; the last one filled with padding rows (not editable)."""
  chunks = [rows[start : start + batch_size] for start in range(0, len(rows), batch_size)]
  return [pad_rows(dense_batch(chunk), batch_size - len(chunk)) for chunk in chunks]


class BatchIterator:
  """Yields source.batch(i) for i = 0, 1, ...; its checkpointable state is the next index."""

  def __init__(self, source, next_batch_index: int = 0):
    self.source = source
    self.next_batch_index = next_batch_index

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = self.source.batch(self.next_batch_index)
    self.next_batch_index += 1
    return batch

  def get_state(self) -> dict:
    return {"next_batch_index": self.next_batch_index}

  def set_state(self, state: dict):
    self.next_batch_index = int(state["next_batch_index"])

  def close(self):
    pass  # Nothing to release: batches are computed on demand.


_BATCHES_PER_DRAW = 32


class MarkovSource:
  """Sequences of `groundtruth.MarkovLanguage`, whose exact entropy is known.

  shard = (index, count): this process holds rows [index·B/count, (index+1)·B/count) of every
  global batch of B rows, training or evaluation.
  """

  def __init__(self, config: ml_collections.ConfigDict, shard: tuple[int, int] = (0, 1)):
    data = config.data
    self.language = groundtruth.MarkovLanguage(
      data.vocab_size, seed=data.language_seed, concentration=data.concentration
    )
    self.seq_len = data.seq_len
    self.global_batch_size = config.batch_size
    self.shard_index, self.shard_count = shard
    self._train_key = rng.stream(config.seed, "train_data")
    self._drawn, self._drawn_from = (
      None,
      None,
    )  # Training batches [k, B, L] from batch _drawn_from on.
    # Evaluation sequences depend on the language only, so runs with different seeds compare.
    self._eval_key = rng.stream(data.language_seed, "eval_data")

  def batch(self, index: int) -> dict:
    """This process's rows of global batch `index`: the same rows on any process layout.

    Batch i is sample(fold_in(train key, i)); they are drawn _BATCHES_PER_DRAW at a time,
    since one call per batch (an L-step scan) made a small model's train step wait for its
    batch (docs/performance.md).
    """
    first, offset = divmod(index, _BATCHES_PER_DRAW)
    first *= _BATCHES_PER_DRAW
    if self._drawn_from != first:
      indices = np.arange(first, first + _BATCHES_PER_DRAW)
      self._drawn = np.asarray(
        self.language.sample_many(self._train_key, indices, self.global_batch_size, self.seq_len)
      )
      self._drawn_from = first
    size = self.global_batch_size // self.shard_count
    return dense_batch(self._drawn[offset, self.shard_index * size : (self.shard_index + 1) * size])

  def train_iterator(self) -> BatchIterator:
    return BatchIterator(self)

  def eval_batches(self, num_sequences: int, batch_size: int) -> list:
    """This process's block of each global evaluation batch (every process draws the same rows)."""
    rows = np.asarray(self.language.sample(self._eval_key, num_sequences, self.seq_len))
    size = batch_size // self.shard_count
    block = slice(self.shard_index * size, (self.shard_index + 1) * size)
    return [
      {k: None if v is None else v[block] for k, v in batch.items()}
      for batch in _padded_batches(rows, batch_size)
    ]

  @property
  def true_bits_per_token(self) -> Optional[float]:
    """Exact entropy of a sequence, in bits per token."""
    return self.language.entropy(self.seq_len) / (self.seq_len * np.log(2.0))

  def true_bits_per_token_of(self, tokens: np.ndarray) -> Optional[np.ndarray]:
    """−log2 p(x) / L of each sequence under the true language [B]."""
    return -np.asarray(self.language.log_prob(tokens)) / (tokens.shape[1] * np.log(2.0))

  def text_lengths(self, tokens: np.ndarray, editable: np.ndarray) -> None:
    """Markov ids are not text: no characters or bytes to count."""
    del tokens, editable

  def decode(self, tokens: np.ndarray) -> str:
    """Markov ids have no text: space-separated ids."""
    return " ".join(str(int(t)) for t in tokens)

  def token_text(self, token: int) -> str:
    return str(int(token))

  def encode(self, text: str) -> np.ndarray:
    """Space-separated ids, e.g. a prompt "3 17 5"."""
    try:
      ids = np.asarray([int(part) for part in text.split()], np.int32)
    except ValueError:
      raise ValueError(f"A markov prompt is space-separated token ids, got {text!r}.") from None
    if ids.size and not (0 <= ids.min() and ids.max() < self.language.vocab_size):
      raise ValueError(f"Prompt ids must be in [0, {self.language.vocab_size}), got {text!r}.")
    return ids


class TextSource:
  """A tokenized corpus (text8, local text or conditional pairs, LM1B, OWT) through md4jax.data.pipeline."""

  true_bits_per_token = None  # Real text: the entropy is unknown.

  def __init__(
    self, config: ml_collections.ConfigDict, workdir: Optional[str], shard: tuple[int, int] = (0, 1)
  ):
    self.config = config
    self.shard_index, self.shard_count = shard
    self.data = pipeline.load_data(config, workdir)
    self.tokenizer = self.data.tokenizer
    if config.data.vocab_size not in (0, self.tokenizer.vocab_size):
      raise ValueError(
        f"Invalid config: data.vocab_size={config.data.vocab_size} but the {config.data.dataset} "
        f"tokenizer has {self.tokenizer.vocab_size} ids; set --config.data.vocab_size="
        f"{self.tokenizer.vocab_size} (the mask id is one past the last token id)."
      )

  def train_iterator(self) -> pipeline.TrainIterator:
    return self.data.train_iterator(
      batch_size=self.config.batch_size // self.shard_count,
      seed=self.config.seed,
      worker_count=self.config.data.worker_count,
      shard_index=self.shard_index,
      shard_count=self.shard_count,
    )

  def eval_batches(self, num_sequences: int, batch_size: int):
    """The first batches of the validation split's rows, enough for num_sequences rows."""
    batches = self.data.eval_batches(
      batch_size=batch_size // self.shard_count,
      shard_index=self.shard_index,
      shard_count=self.shard_count,
    )
    return itertools.islice(batches, -(-num_sequences // batch_size))

  def true_bits_per_token_of(self, tokens: np.ndarray) -> Optional[np.ndarray]:
    del tokens
    return None

  def text_lengths(self, tokens: np.ndarray, editable: np.ndarray) -> tuple[int, Optional[int]]:
    """(characters, UTF-8 bytes) of the editable tokens, each row decoded on its own; bytes None
    where the tokenizer has no exact byte count, or no token is editable."""
    characters = sum(len(self.decode(row[keep])) for row, keep in zip(tokens, editable))
    byte_lengths = self.tokenizer.byte_lengths  # None: the tokenizer has no exact byte count.
    if byte_lengths is None or not editable.any():
      return characters, None
    return characters, int(byte_lengths[tokens[editable]].sum())

  def decode(self, tokens: np.ndarray) -> str:
    return self.tokenizer.decode([int(t) for t in tokens])

  def token_text(self, token: int) -> str:
    return self.tokenizer.decode([int(token)])

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.tokenizer.encode(text), np.int32)


def with_vocab_size(config: ml_collections.ConfigDict, source: Source) -> ml_collections.ConfigDict:
  """config with data.vocab_size = 0 replaced by the source's tokenizer's size (config itself
  when it is set)."""
  if config.data.vocab_size:
    return config
  resolved = config.copy_and_resolve_references()
  resolved.data.vocab_size = source.tokenizer.vocab_size
  return resolved


def make_source(
  config: ml_collections.ConfigDict, workdir=None, shard: tuple[int, int] = (0, 1)
) -> Source:
  """The data source named by config.data.dataset (text tokenizers are saved in workdir).

  shard = (index, count): the block of every global batch this process holds
  (`md4jax.runtime.sharding.process_batch_shard`); (0, 1) holds the whole batch.
  """
  if config.data.dataset == "markov":
    return MarkovSource(config, shard)
  return TextSource(config, None if workdir is None else str(workdir), shard)
