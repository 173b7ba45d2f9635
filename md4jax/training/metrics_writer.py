"""Run outputs in WORKDIR: metrics.jsonl, eval.json, samples.jsonl, TensorBoard events, progress line.

Only process 0 writes. TensorBoard events come from tensorboardX (no TensorFlow).
"""

import json
import math
import sys

import jax
import tensorboardX

from md4jax.runtime import workdir as workdir_lib


def _to_json(value):
  value = float(value) if hasattr(value, "dtype") else value
  return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsWriter:
  """Appends train metrics, writes eval results and samples, mirrors scalars to TensorBoard."""

  def __init__(self, workdir):
    self.workdir = workdir_lib.as_workdir(workdir)
    self.active = jax.process_index() == 0
    self._events = None  # Opened by the first scalar: a run that fails first writes no file.

  @property
  def _tensorboard(self) -> tensorboardX.SummaryWriter:
    if self._events is None:
      self._events = tensorboardX.SummaryWriter(str(self.workdir.tensorboard))
    return self._events

  def drop_records_after(self, step: int):
    """A training run resumes at `step`: its later metrics.jsonl records (logged by a run killed
    after its last checkpoint) are redone, so they are dropped."""
    path = self.workdir.metrics_jsonl
    if not self.active or not path.exists():
      return
    kept = []
    for line in path.read_text().splitlines():
      try:
        record = json.loads(line)
      except ValueError:
        continue  # The end of a line cut by a kill: the step is redone.
      if record["step"] <= step:
        kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))

  def write_train(self, step: int, metrics: dict):
    if not self.active:
      return
    record = {"step": step, **{k: _to_json(v) for k, v in metrics.items()}}
    with open(self.workdir.metrics_jsonl, "a") as f:
      f.write(json.dumps(record) + "\n")
    for name, value in record.items():
      if name != "step" and isinstance(value, (int, float)):
        self._tensorboard.add_scalar(f"train/{name}", value, step)

  def write_eval(self, step: int, results: dict):
    """eval.json holds the latest evaluation; TensorBoard keeps the history."""
    if not self.active:
      return
    record = {"step": step, **{k: _to_json(v) for k, v in results.items()}}
    self.workdir.eval_json.write_text(json.dumps(record, indent=2) + "\n")
    for name, value in record.items():
      if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
        self._tensorboard.add_scalar(f"eval/{name}", value, step)

  def write_samples(self, records: list[dict]):
    """samples.jsonl holds the latest samples, one JSON object per sequence."""
    if not self.active:
      return
    with open(self.workdir.samples_jsonl, "w") as f:
      for record in records:
        f.write(json.dumps({k: _to_json(v) for k, v in record.items()}) + "\n")

  def close(self):
    if self._events is not None:
      self._events.close()


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

  def update(self, step: int, loss: float, tokens_per_second: float, seconds_per_step: float):
    line = (
      f"step {step}/{self.num_train_steps}  loss {loss:.4f}  "
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
