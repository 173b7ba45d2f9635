"""Preference pairs for DPO / VRPO (post_train.pairs): JSONL records {prompt, chosen, rejected}.

Each pair becomes two rows as conditional data lays them out, [prompt][response][EOS] then
padding, the response (and its EOS) editable, one for the chosen response and one for the
rejected. Step s reads pairs s·B .. s·B + B − 1 of a permutation of the pairs per epoch
(seeded), so a resumed run reads what the uninterrupted one would.
"""

import json
import pathlib
from typing import Callable, Optional

import numpy as np

from md4jax.data import pipeline

FIELDS = ("prompt", "chosen", "rejected")


class PairsError(ValueError):
  """A pairs file that cannot be read: one line naming the file (and line) and the problem."""


def read_pairs(path, encode: Callable, eos_id: Optional[int], seq_len: int) -> dict:
  """{"chosen": rows, "rejected": rows}, each a dict of [N, seq_len] arrays; PairsError if the
  file is missing, a line is not a JSON object with the three string fields, or a pair's row is
  longer than seq_len."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise PairsError(f"post_train.pairs={str(path)!r}: no such file.")
  eos = np.asarray([] if eos_id is None else [eos_id], np.int32)
  rows = {"chosen": [], "rejected": []}
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    where = f"{path}:{number}"
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise PairsError(f"{where}: not JSON ({e.msg}).") from None
    missing = [f for f in FIELDS if not isinstance(record, dict) or f not in record]
    if missing:
      raise PairsError(
        f"{where}: a preference pair needs {', '.join(FIELDS)}; missing {', '.join(missing)}."
      )
    if not all(isinstance(record[f], str) for f in FIELDS):
      raise PairsError(f"{where}: {', '.join(FIELDS)} must be strings.")
    prompt = np.asarray(encode(record["prompt"]), np.int32)
    for side in ("chosen", "rejected"):
      response = np.concatenate([np.asarray(encode(record[side]), np.int32), eos])
      if len(prompt) + len(response) > seq_len:
        raise PairsError(
          f"{where}: the prompt and the {side} response are {len(prompt) + len(response)} "
          f"tokens, more than data.seq_len={seq_len}."
        )
      example = np.concatenate([prompt, response])
      rows[side].append(pipeline.packed_row(example, seq_len, [0], [len(example)], [len(prompt)]))
  if not rows["chosen"]:
    raise PairsError(f"post_train.pairs={str(path)!r}: no pairs in the file.")
  return {
    side: {name: np.stack([row[name] for row in side_rows]) for name in side_rows[0]}
    for side, side_rows in rows.items()
  }


def batch_at(pairs: dict, step: int, batch_size: int, seed: int) -> tuple[dict, dict]:
  """(chosen rows, rejected rows) [batch_size, L] of step (1-based): pairs (step − 1)·B .. of a
  seeded permutation per epoch."""
  count = len(pairs["chosen"]["tokens"])
  start = (step - 1) * batch_size
  orders, indices = {}, []
  for position in range(start, start + batch_size):
    epoch, offset = divmod(position, count)
    if epoch not in orders:
      orders[epoch] = np.random.default_rng([seed, epoch]).permutation(count)
    indices.append(orders[epoch][offset])
  pick = lambda rows: {name: value[indices] for name, value in rows.items()}
  return pick(pairs["chosen"]), pick(pairs["rejected"])
