r"""Block diffusion's bound against the block size at equal steps: one training run per block size,
one JSON line each (the evaluated NELBO in bits/token ± SE; with a generated language, its exact
entropy and the paired excess).

  python benchmarks/block_sizes.py --config=configs/default.py:bd3 --block_sizes=1,4,16,64
  python benchmarks/block_sizes.py --config=configs/text8.py:cpu_bd3 --block_sizes=4,16,128 \
      --override=data.path=text8.zip

Every run is `python -m md4jax.main` with --config.diffusion.block_size=b (b = seq_len: the MDM
trained the same way) in a fresh workdir under --workdir; --override adds config keys to all.
"""

import json
import pathlib
import subprocess
import sys
import tempfile

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "configs/default.py:bd3", "The config of every run.")
_BLOCK_SIZES = flags.DEFINE_list("block_sizes", ["1", "4", "16", "64"], "Block sizes to train.")
_OVERRIDES = flags.DEFINE_list("override", [], "key=value config overrides for every run.")
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Where the runs' workdirs go (default: a temp dir)."
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv):
  del argv
  workdirs = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="block_sizes_"))
  for size in map(int, _BLOCK_SIZES.value):
    workdir = workdirs / f"b{size}"
    command = [
      sys.executable,
      "-m",
      "md4jax.main",
      f"--config={_CONFIG.value}",
      f"--workdir={workdir}",
      f"--config.diffusion.block_size={size}",
      "--config.sample.num_samples=0",
      *(f"--config.{override}" for override in _OVERRIDES.value),
    ]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((workdir / "eval.json").read_text())
    keys = (
      "nelbo_bits_per_token",
      "nelbo_bits_per_token_stderr",
      "true_bits_per_token",
      "excess_bits_per_token",
      "excess_bits_per_token_stderr",
      "estimator",
      "num_sequences",
      "step",
    )
    print(
      json.dumps({"block_size": size, **{k: result[k] for k in keys if k in result}}), flush=True
    )


if __name__ == "__main__":
  app.run(main)
