"""The progress line's ETA counts the periodic evaluations and checkpoints still to come."""

import io

from md4jax.training.progress import ProgressLine


def test_eta_counts_the_evaluations_and_checkpoints_to_come():
  progress = ProgressLine(
    600, eval_every_steps=100, checkpoint_every_steps=200, stream=io.StringIO()
  )
  # At step 50, 5 evaluations (100..500; the last step's is the final one) and 2 saves (200,
  # 400) are still to come, none timed yet: the line says so instead of hiding them.
  assert progress.eta(50, 0.1) == "0:55 + 5 evaluations and 2 checkpoints not timed yet"
  progress.record("evaluation", 6.0)
  progress.record("checkpoint", 0.5)
  # At step 100 (its evaluation just done): 500 steps, 4 evaluations, 2 saves.
  assert progress.eta(100, 0.1) == "1:15"  # 50 s of steps + 4 × 6 s + 2 × 0.5 s.
  assert progress.eta(599, 0.1) == "0:00"


def test_the_printed_line_carries_the_eta():
  stream = io.StringIO()
  progress = ProgressLine(10, eval_every_steps=5, stream=stream)
  progress.update(2, 1.5, 1000.0, 1.0)
  assert (
    stream.getvalue()
    == "step 2/10  loss 1.5000  1,000 tokens/s  ETA 0:08 + 1 evaluation not timed yet\n"
  )
