"""Stopping a run cleanly on SIGTERM (preemption) or Ctrl-C: finish the step in flight, save a
checkpoint at that step, and exit 0; a second Ctrl-C aborts at once.

With one process the first SIGTERM or SIGINT sets a flag the training loop reads
after every step. Several processes must stop at one and the same step: a
SIGTERM reaches jax.distributed's preemption sync point (the coordination
service tells every process, and `reached_preemption_sync_point` turns true on
all of them at the same step), and a Ctrl-C on any process is turned into a
SIGTERM to itself, which takes the same path.
"""

import os
import signal
import sys
import threading
from typing import Optional

import jax
from jax.experimental import multihost_utils


class StopSignals:
  """Context manager: while active, SIGTERM and SIGINT ask the training loop to stop."""

  def __init__(self):
    self.received: Optional[str] = None  # The first signal's name, on this process.
    self._previous: dict = {}
    self._distributed = False

  def __enter__(self) -> "StopSignals":
    self._distributed = jax.process_count() > 1
    # Several processes: jax.distributed's own SIGTERM handler feeds the sync point; keep it.
    handled = [signal.SIGINT] if self._distributed else [signal.SIGINT, signal.SIGTERM]
    if threading.current_thread() is threading.main_thread():  # Python's rule for handlers.
      for signum in handled:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.received is not None:
      if signum == signal.SIGINT:
        raise KeyboardInterrupt(f"Second {name}: aborting at once, without a checkpoint.")
      return
    self.received = name
    print(
      f"\nReceived {name}: finishing the step in flight, then saving a checkpoint "
      "(press Ctrl-C again to abort at once).",
      file=sys.stderr,
      flush=True,
    )
    if self._distributed and signum == signal.SIGINT:
      os.kill(os.getpid(), signal.SIGTERM)  # Through jax.distributed: all stop at one step.

  def stop_after(self, step: int) -> bool:
    """True once the run should stop after `step`: the same step on every process."""
    if self._distributed:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.received is not None
