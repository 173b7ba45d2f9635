"""Run outputs in WORKDIR: metrics.jsonl, eval.json, samples.jsonl, TensorBoard events.

Only process 0 writes. TensorBoard events come from tensorboardX (no TensorFlow).
"""

import json
import math

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
