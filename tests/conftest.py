"""Test-wide setup: 8 fake CPU devices for sharding tests.

XLA reads the flag once, when the backend starts, so it must be set before the
first `import jax` of the test session; conftest.py is imported first.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long-running test, excluded by default (-m slow runs it)")


def pytest_sessionstart(session):
  # The flag only works if jax was not imported before this file; fail loudly otherwise.
  import jax  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == 8 or jax.default_backend() != "cpu", (
      "jax was imported before tests/conftest.py set XLA_FLAGS; sharding tests need 8 CPU devices.")
