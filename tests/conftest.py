"""Test-wide setup: 8 fake CPU devices for sharding tests, and a compilation cache.

XLA reads the flag once, when the backend starts, so it must be set before the
first `import jax` of the test session; conftest.py is imported first.
"""

import os
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs are cached on disk for the session and the CLI subprocesses it starts:
# they compile the same small programs again and again.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="md4jax-test-jit-cache-")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  # The tests' programs are small and compiled once or twice each: compiling them without
  # LLVM optimizations takes a third less time than running them optimized saves.
  os.environ["XLA_FLAGS"] = (
    _flags + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  ).strip()


def pytest_configure(config):
  config.addinivalue_line(
    "markers", "slow: long-running test, excluded by default (-m slow runs it)"
  )


def pytest_sessionstart(session):
  # The flag only works if jax was not imported before this file; fail loudly otherwise.
  import jax  # pylint: disable=g-import-not-at-top

  assert jax.device_count() == 8 or jax.default_backend() != "cpu", (
    "jax was imported before tests/conftest.py set XLA_FLAGS; sharding tests need 8 CPU devices."
  )


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program after each test file. jit's caches keep each program alive
  (its machine code mapped) for the whole session; past ~480 tests XLA:CPU crashed compiling or
  serializing the next one (a segfault, 2026-12-06, jax 0.10.2) where each file alone passes."""
  yield
  import jax  # pylint: disable=g-import-not-at-top

  jax.clear_caches()
