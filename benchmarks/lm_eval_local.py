r"""Local lm-evaluation-harness tasks for an md4jax workdir trained on the generated Markov language
(md4jax.app.harness_tasks), and the true chain's figures on their documents, as one JSON
line: what the md4jax model's lm-eval numbers read against (docs/lm_eval.md).

  python benchmarks/lm_eval_local.py --workdir=/tmp/md4jax_tiny --out=/tmp/md4jax_tasks
  python -m md4jax.lm_eval --model md4jax --model_args workdir=/tmp/md4jax_tiny,draws=8 \
      --tasks md4jax_markov_choice,md4jax_markov_rolling,md4jax_markov_gen \
      --include_path /tmp/md4jax_tasks --batch_size 32
"""

import json

from absl import app, flags

from md4jax import config as config_lib
from md4jax.app import harness_tasks
from md4jax.data import sources

_WORKDIR = flags.DEFINE_string("workdir", None, "A workdir of data.dataset='markov'.")
_OUT = flags.DEFINE_string("out", None, "The folder for the tasks (lm-eval's --include_path).")
_QUESTIONS = flags.DEFINE_integer("questions", 64, "Questions of the multiple-choice task.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the tasks' documents.")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  del argv
  config = config_lib.workdir_config(_WORKDIR.value, "--workdir")
  if config.data.dataset != "markov":
    raise app.UsageError(f"{_WORKDIR.value} models {config.data.dataset!r}, not 'markov'.")
  exact = harness_tasks.write_tasks(
    _OUT.value,
    sources.MarkovSource(config).language,
    config.data.seq_len,
    num_questions=_QUESTIONS.value,
    seed=_SEED.value,
  )
  print(json.dumps({"tasks": _OUT.value, "true_chain": exact}))


if __name__ == "__main__":
  app.run(main)
