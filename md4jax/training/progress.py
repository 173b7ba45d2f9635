"""The training loop's progress line, with an ETA that counts what the loop has still to do."""

import sys


class ProgressLine:
  """One progress line: rewritten in place on a terminal, else printed once per log step.

  Its ETA counts what the rest of the training loop will do: the steps at the last logged
  rate, and the periodic evaluations and checkpoint saves still to come at their last
  measured cost (before the first is timed, the line says how many are not counted yet).
  The final evaluation and sampling follow the loop and print their own times.
  """

  def __init__(
    self,
    num_train_steps: int,
    eval_every_steps: int = 0,
    checkpoint_every_steps: int = 0,
    stream=sys.stdout,
  ):
    self.num_train_steps = num_train_steps
    self.eval_every_steps, self.checkpoint_every_steps = eval_every_steps, checkpoint_every_steps
    self.seconds = {"evaluation": None, "checkpoint": None}  # The last measured cost of each.
    self.stream = stream
    self.in_place = stream.isatty()

  def record(self, what: str, seconds: float):
    """The cost of a periodic evaluation or a checkpoint save just made."""
    self.seconds[what] = seconds

  def _remaining(self, step: int, every: int) -> int:
    """Periodic events after `step`, the last step excluded (it is handled on its own)."""
    if every <= 0:
      return 0
    return max((self.num_train_steps - 1) // every - step // every, 0)

  def eta(self, step: int, seconds_per_step: float) -> str:
    seconds, untimed = max(self.num_train_steps - step, 0) * seconds_per_step, []
    for what, every in (
      ("evaluation", self.eval_every_steps),
      ("checkpoint", self.checkpoint_every_steps),
    ):
      count = self._remaining(step, every)
      if count and self.seconds[what] is None:
        untimed.append(f"{count} {what}{'s' if count > 1 else ''}")
      elif count:
        seconds += count * self.seconds[what]
    text = _format_duration(seconds)
    return f"{text} + {' and '.join(untimed)} not timed yet" if untimed else text

  def update(
    self,
    step: int,
    loss: float,
    tokens_per_second: float,
    seconds_per_step: float,
    name: str = "loss",
    extra: str = "",
  ):
    """`loss`: the figure the line shows, under `name` (post-training's: the mean reward), then
    `extra`."""
    line = (
      f"step {step}/{self.num_train_steps}  {name} {loss:.4f}{extra}  "
      f"{tokens_per_second:,.0f} tokens/s  ETA {self.eta(step, seconds_per_step)}"
    )
    if self.in_place:
      self.stream.write("\r" + line.ljust(79))
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def finish(self):
    if self.in_place:
      self.stream.write("\n")
      self.stream.flush()


def _format_duration(seconds: float) -> str:
  seconds = int(round(seconds))
  minutes, seconds = divmod(seconds, 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"
