"""Training and evaluation data: the generated Markov language, or a local text8 file.

Every training batch is a pure function of (seed, batch index), so the
iterator's whole state is the next batch index: it is checkpointed with the
train state and a resumed run sees exactly the batches it would have seen.
"""

import pathlib
from typing import Optional

import jax
import ml_collections
import numpy as np

from md4jax import config_lib
from md4jax import groundtruth

TEXT8_ALPHABET = "abcdefghijklmnopqrstuvwxyz "
assert len(TEXT8_ALPHABET) == config_lib.TEXT8_VOCAB_SIZE
# text8 files hold no held-out split; the last share of the file is held out for eval.
TEXT8_EVAL_FRACTION = 0.1


class MarkovSource:
  """Sequences of `groundtruth.MarkovLanguage`, whose exact entropy is known."""

  def __init__(self, config: ml_collections.ConfigDict):
    data = config.data
    self.language = groundtruth.MarkovLanguage(data.vocab_size, seed=data.language_seed,
                                               concentration=data.concentration)
    self.seq_len = data.seq_len
    self.batch_size = config.batch_size
    self._train_key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
    # Evaluation sequences depend on the language only, so runs with different seeds compare.
    self._eval_key = jax.random.fold_in(jax.random.PRNGKey(data.language_seed), 2)

  def batch(self, index: int) -> np.ndarray:
    key = jax.random.fold_in(self._train_key, index)
    return np.asarray(self.language.sample(key, self.batch_size, self.seq_len))

  def eval_sequences(self, num_sequences: int) -> np.ndarray:
    return np.asarray(self.language.sample(self._eval_key, num_sequences, self.seq_len))

  @property
  def true_bits_per_token(self) -> Optional[float]:
    """Exact entropy of a sequence, in bits per token."""
    return self.language.entropy(self.seq_len) / (self.seq_len * np.log(2.0))

  def true_bits_per_token_of(self, tokens: np.ndarray) -> Optional[np.ndarray]:
    """−log2 p(x) / L of each sequence under the true language [B]."""
    return -np.asarray(self.language.log_prob(tokens)) / (self.seq_len * np.log(2.0))

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


class Text8Source:
  """Random windows of a text8-format file: chars a-z and space, one id each."""

  def __init__(self, config: ml_collections.ConfigDict):
    path = pathlib.Path(config.data.path)
    if not path.is_file():
      raise FileNotFoundError(f"config.data.path={str(path)!r} is not a file (text8 format expected).")
    text = path.read_text(encoding="utf-8").strip()
    lookup = np.full(256, 255, np.uint8)
    lookup[np.frombuffer(TEXT8_ALPHABET.encode(), np.uint8)] = np.arange(len(TEXT8_ALPHABET))
    ids = lookup[np.frombuffer(text.encode("utf-8"), np.uint8)]
    if (ids == 255).any():
      bad = sorted(set(text) - set(TEXT8_ALPHABET))[:10]
      raise ValueError(f"{path} is not text8-format: characters outside a-z and space: {bad}.")
    split = int(len(ids) * (1.0 - TEXT8_EVAL_FRACTION))
    self.train_ids, self.eval_ids = ids[:split], ids[split:]
    self.seq_len = config.data.seq_len
    self.batch_size = config.batch_size
    self.seed = config.seed
    if min(len(self.train_ids), len(self.eval_ids)) < self.seq_len:
      raise ValueError(f"{path} has too few characters ({len(ids)}) for seq_len={self.seq_len}.")

  def batch(self, index: int) -> np.ndarray:
    rng = np.random.default_rng((self.seed, index))
    starts = rng.integers(0, len(self.train_ids) - self.seq_len + 1, size=self.batch_size)
    return self.train_ids[starts[:, None] + np.arange(self.seq_len)].astype(np.int32)

  def eval_sequences(self, num_sequences: int) -> np.ndarray:
    """The first `num_sequences` disjoint windows of the held-out text (fewer if it is short)."""
    available = len(self.eval_ids) // self.seq_len
    count = min(num_sequences, available)
    return self.eval_ids[:count * self.seq_len].reshape(count, self.seq_len).astype(np.int32)

  @property
  def true_bits_per_token(self) -> Optional[float]:
    return None  # Real text: the entropy is unknown.

  def true_bits_per_token_of(self, tokens: np.ndarray) -> Optional[np.ndarray]:
    del tokens
    return None

  def decode(self, tokens: np.ndarray) -> str:
    return "".join(TEXT8_ALPHABET[int(t)] for t in tokens)

  def token_text(self, token: int) -> str:
    return TEXT8_ALPHABET[int(token)]

  def encode(self, text: str) -> np.ndarray:
    unknown = sorted(set(text) - set(TEXT8_ALPHABET))
    if unknown:
      raise ValueError(f"A text8 prompt holds only a-z and spaces; got {unknown} in {text!r}.")
    return np.asarray([TEXT8_ALPHABET.index(c) for c in text], np.int32)


def make_source(config: ml_collections.ConfigDict):
  """The data source named by config.data.dataset."""
  if config.data.dataset == "markov":
    return MarkovSource(config)
  return Text8Source(config)


class BatchIterator:
  """Yields source batches in order; its checkpointable state is the next batch index."""

  def __init__(self, source, next_batch_index: int = 0):
    self.source = source
    self.next_batch_index = next_batch_index

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    batch = self.source.batch(self.next_batch_index)
    self.next_batch_index += 1
    return batch

  def get_state(self) -> dict:
    return {"next_batch_index": self.next_batch_index}

  def set_state(self, state: dict):
    self.next_batch_index = int(state["next_batch_index"])
