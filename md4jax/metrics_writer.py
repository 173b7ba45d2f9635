"""Run outputs in WORKDIR: metrics.jsonl, eval.json, samples.jsonl, TensorBoard events, progress line.

Only process 0 writes. TensorBoard events come from tensorboardX (no TensorFlow).
"""

import json
import math
import sys
from typing import Optional

import jax
import tensorboardX

from md4jax import workdir as workdir_lib


def _to_json(value):
  value = float(value) if hasattr(value, "dtype") else value
  return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsWriter:
  """Appends train metrics, writes eval results and samples, mirrors scalars to TensorBoard."""

  def __init__(self, workdir, drop_records_after: Optional[int] = None):
    """drop_records_after: a training run's start step; later metrics.jsonl records are redone."""
    self.workdir = workdir_lib.as_workdir(workdir)
    self.active = jax.process_index() == 0
    if not self.active:
      return
    self.workdir.root.mkdir(parents=True, exist_ok=True)
    if drop_records_after is not None:
      self._drop_records_after(drop_records_after)
    self._tensorboard = tensorboardX.SummaryWriter(str(self.workdir.tensorboard))

  def _drop_records_after(self, step: int):
    """A run killed after its last checkpoint logged steps it will redo on resume; drop them."""
    path = self.workdir.metrics_jsonl
    if not path.exists():
      return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
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
    if self.active:
      self._tensorboard.close()


class ProgressLine:
  """One progress line: rewritten in place on a terminal, else printed once per log step."""

  def __init__(self, num_train_steps: int, stream=sys.stdout):
    self.num_train_steps = num_train_steps
    self.stream = stream
    self.in_place = stream.isatty()

  def update(self, step: int, loss: float, tokens_per_second: float, seconds_per_step: float):
    eta = max(self.num_train_steps - step, 0) * seconds_per_step
    line = (f"step {step}/{self.num_train_steps}  loss {loss:.4f}  "
            f"{tokens_per_second:,.0f} tokens/s  ETA {_format_duration(eta)}")
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
