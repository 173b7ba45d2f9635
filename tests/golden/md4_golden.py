"""What tests/golden/make_md4_golden.py writes and tests/test_md4_parity.py reads: the small MD4
model's shape, the training run's settings, the files and the deterministic param perturbation.

No MD4 code here: numpy only.
"""

import pathlib

import numpy as np

DIR = pathlib.Path(__file__).resolve().parent
INIT = DIR / "md4_init.npz"  # MD4's initial params, keys "classifier/.../kernel".
LOGITS = DIR / "md4_logits.npz"  # Fixed inputs and MD4's logits on them.
TRAIN = DIR / "md4_train.npz"  # MD4's 300-step run: batches, its draws, its losses.

# MD4's text8 network (md4/configs/md4/text8.py), shrunk: 2 layers, width 64 = 2 heads × 32
# (feature_dim = 32 is also the token- and time-embedding width), MLP 192 by MD4's formula.
NUM_LAYERS, NUM_HEADS, FEATURE_DIM = 2, 2, 32
MODEL_DIM = NUM_HEADS * FEATURE_DIM
SEQ_LEN, VOCAB_SIZE, BATCH_SIZE = 32, 27, 8
# The run: MD4's optimizer (AdamW b1 0.9, b2 0.999, no weight decay, no clipping, EMA 0.9999
# from step 0) with a schedule that learns within 300 steps.
NUM_STEPS, LEARNING_RATE, WARMUP_STEPS, EMA_DECAY, SEED = 300, 1e-3, 30, 0.9999, 0
# Leaves whose final raw and EMA values are stored (the whole tree would double the files).
FINAL_LEAVES = (
  "classifier/Transformer_0/Dense_2/kernel",
  "classifier/Transformer_0/TransformerBlock_0/Dense_0/bias",
  "classifier/CondEmbedding_0/dense0/bias",
  "classifier/Embed_0/embedding",
)

PERTURB_SCALE = 0.05


def perturb(flat: dict) -> dict:
  """Params far from MD4's init (whose zero adaLN and output layers make every logit 0):
  leaf k (in sorted key order) gets PERTURB_SCALE · sin(0.7 (k + 1) (i + 1)) added at flat
  index i, in float32."""
  out = {}
  for k, name in enumerate(sorted(flat)):
    leaf = np.asarray(flat[name], np.float32)
    index = np.arange(1, leaf.size + 1, dtype=np.float64).reshape(leaf.shape)
    out[name] = (leaf + PERTURB_SCALE * np.sin(0.7 * (k + 1) * index)).astype(np.float32)
  return out


def flatten(tree: dict, prefix: str = "") -> dict:
  """{"a/b/c": array} of a nested dict of arrays."""
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict) or hasattr(value, "items"):
      flat.update(flatten(dict(value), name + "/"))
    else:
      flat[name] = np.asarray(value)
  return flat


def unflatten(flat: dict) -> dict:
  """The nested dict of a `flatten` output."""
  tree = {}
  for name, value in flat.items():
    *parents, leaf = name.split("/")
    node = tree
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = np.asarray(value)
  return tree


def load(path: pathlib.Path, prefix: str = "") -> dict:
  """The arrays of an npz file (those under `prefix`, with it removed)."""
  with np.load(path) as data:
    return {k[len(prefix) :]: data[k] for k in data.files if k.startswith(prefix)}
