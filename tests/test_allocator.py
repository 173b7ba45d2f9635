"""The host allocator setting, in fresh processes (it must precede JAX's threads)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Page faults per call of a program with a 128 MB temporary, after
# allocator.reuse_freed_host_memory() or without it.
_FAULTS_PER_CALL = """
import resource, sys
from md4jax import allocator
applied = allocator.reuse_freed_host_memory() if sys.argv[1] == "reuse" else None
import jax, jax.numpy as jnp
from md4jax import model
attention = jax.jit(model.softmax_attention)
q = jnp.ones((4, 1024, 8, 16))  # Scores [4, 8, 1024, 1024] float32: 128 MB.
for _ in range(2):
  attention(q, q, q).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
  attention(q, q, q).block_until_ready()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def _faults_per_call(mode):
  result = subprocess.run([sys.executable, "-c", _FAULTS_PER_CALL, mode], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
  applied, faults = result.stdout.split()
  return applied, float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator is Linux's")
def test_reused_host_memory_stops_page_faults_of_fresh_temporaries():
  applied, faults = _faults_per_call("reuse")
  if applied != "True":
    pytest.skip("not glibc, or an accelerator host: the allocator is left alone")
  _, faults_without = _faults_per_call("default")
  assert faults_without > 10_000  # Every page of the fresh temporary faults (32,768 of 4 KiB).
  assert faults < 1_000, f"{faults} page faults per call with the freed memory reused"
