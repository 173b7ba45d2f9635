"""The run's named random streams: each use of a seed folds in its own number, named here once.

A stream is fold_in(PRNGKey(seed), number). The numbers are part of every result (the data, the
evaluation draws, the samples): renumbering one changes what a seed gives. The params' init and
the per-step training key are split from PRNGKey(config.seed) itself (md4jax.training.state).
"""

import jax

STREAMS = {
  "train_data": 1,  # markov: the training batches (seed: config.seed).
  "eval_data": 2,  # markov: the evaluation rows (seed: data.language_seed, so seeds compare).
  "eval": 3,  # Evaluation's draws of t and masks, one fold per batch.
  "sample": 4,  # The samples at the end of training and of --mode=sample.
  "judged_samples": 5,  # The fresh samples the AR judge scores (eval.judge_workdir).
  "frontier": 6,  # --mode=frontier's samples, one fold per point.
  "lm_eval": 7,  # The lm-evaluation-harness model's draws (md4jax.app.harness_model).
  "post_train": 8,  # --mode=post_train's rollouts and estimates, one fold per step.
  "distill": 9,  # --mode=distill's times, masks and teacher draws, one fold per step.
}


def stream(seed: int, name: str) -> jax.Array:
  """The key of the stream `name` (a key of STREAMS) of `seed`."""
  return jax.random.fold_in(jax.random.PRNGKey(seed), STREAMS[name])
