r"""Share of a run's sample words that are real words (occur in the training split); prints JSON.

  python benchmarks/sample_words.py --workdir=/tmp/md4jax_text8_cpu --data_path=text8.zip

Reads WORKDIR/samples.jsonl (the latest step's samples) and the training split
of the text8-format corpus (its first 90%, as md4jax.data.corpora.text8 splits it).
The first and last word of each sample are dropped: the window may cut them.
"""

import json
import pathlib

from absl import app, flags

from md4jax.data import corpora

_WORKDIR = flags.DEFINE_string("workdir", None, "A trained run's workdir.", required=True)
_DATA_PATH = flags.DEFINE_string(
  "data_path", None, "text8-format corpus (or text8.zip).", required=True
)


def word_share(texts: list[str], vocabulary: set[str]) -> dict:
  """Words of the texts (inner words only) found in the vocabulary: counts and shares."""
  words = [w for text in texts for w in text.split()[1:-1]]
  real = [w for w in words if w in vocabulary]
  return {
    "num_samples": len(texts),
    "num_words": len(words),
    "num_real_words": len(real),
    "real_word_share": len(real) / max(len(words), 1),
    "real_character_share": sum(map(len, real)) / max(sum(map(len, words)), 1),
  }


def main(argv):
  del argv
  records = [
    json.loads(line)
    for line in (pathlib.Path(_WORKDIR.value) / "samples.jsonl").read_text().splitlines()
    if line
  ]
  if not records:
    raise SystemExit(f"{_WORKDIR.value}/samples.jsonl holds no samples.")
  last = max(record["step"] for record in records)
  texts = [record["text"] for record in records if record["step"] == last]
  train, _, _ = corpora.text8_splits(corpora.read_text8(_DATA_PATH.value))
  result = {"workdir": _WORKDIR.value, "step": last, **word_share(texts, set(train.split()))}
  result["samples"] = texts[:2]
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  app.run(main)
