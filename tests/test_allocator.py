"""The host allocator setting, in fresh processes (it must precede JAX's threads)."""

import pathlib
import subprocess
import sys

import pytest

from md4jax.runtime import allocator

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Page faults per call of a program with a 128 MB temporary, after
# allocator.reuse_freed_host_memory() or without it.
_FAULTS_PER_CALL = """
import resource, sys
from md4jax.runtime import allocator
applied = allocator.reuse_freed_host_memory() if sys.argv[1] == "reuse" else None
import jax, jax.numpy as jnp
from md4jax.model import transformer as model
attention = jax.jit(model.softmax_attention)
q = jnp.ones((4, 1024, 8, 16))  # Scores [4, 8, 1024, 1024] float32: 128 MB.
for _ in range(2):
  attention(q, q, q).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
  attention(q, q, q).block_until_ready()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8)
"""


def _faults_per_call(mode):
  result = subprocess.run(
    [sys.executable, "-c", _FAULTS_PER_CALL, mode],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  applied, faults = result.stdout.split()
  return applied, float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator is Linux's")
@pytest.mark.slow
def test_reused_host_memory_stops_page_faults_of_fresh_temporaries():
  applied, faults = _faults_per_call("reuse")
  if applied != "True":
    pytest.skip("not glibc, or an accelerator host: the allocator is left alone")
  _, faults_without = _faults_per_call("default")
  assert faults_without > 10_000  # Every page of the fresh temporary faults (32,768 of 4 KiB).
  # Reused, the temporary faults no more: what remains are other buffers' fresh 2 MB runs (512
  # pages each, 0-1,536 per call seen), far below the temporary's 32,768 pages.
  assert faults < 32_768 / 8, f"{faults} page faults per call with the freed memory reused"


# Resident MB after a block of the given MB is touched and freed, with the setting applied.
_RESIDENT_AFTER_FREE = """
import sys
import numpy as np
from md4jax.runtime import allocator
applied = allocator.reuse_freed_host_memory()
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before = resident()
block = np.ones(int(sys.argv[1]) * 2**20 // 8)  # Every page touched.
above = np.ones(2**17)  # 1 MB allocated after it: the freed block is not the heap's top, so no trim.
del block
print(applied, resident() - before)
"""


def _resident_after_free(megabytes):
  result = subprocess.run(
    [sys.executable, "-c", _RESIDENT_AFTER_FREE, str(megabytes)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  applied, kept = result.stdout.split()
  return applied, float(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator is Linux's")
@pytest.mark.slow
def test_blocks_from_2_gib_up_are_still_returned_to_the_kernel():
  # The heap keeps what it frees, but not the largest blocks: else 12 layers/768's temporaries
  # grew it past the machine's memory.
  applied, kept_small = _resident_after_free(256)
  if applied != "True":
    pytest.skip("not glibc, or an accelerator host: the allocator is left alone")
  assert kept_small > 200  # Below the threshold: kept for reuse.
  assert allocator.MMAP_THRESHOLD_BYTES < 2304 * 2**20
  _, kept_large = _resident_after_free(2304)  # 2.25 GiB: above it.
  assert kept_large < 50, f"{kept_large} MB of a freed 2.25 GiB block stayed resident"
