"""The programs' way out for an error the user must fix: one line on stderr, exit status 1."""

import contextlib
import sys


@contextlib.contextmanager
def in_one_line(program: str, errors: tuple, traceback: bool = False):
  """Runs the block; an exception of `errors` becomes "PROGRAM: error: MESSAGE" on one line and
  exit status 1, or propagates whole when `traceback` (absl's --verbosity given)."""
  try:
    yield
  except errors as e:
    if traceback:
      raise
    print(f"{program}: error: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(1)
