"""The host allocator: CPU runs reuse freed memory instead of faulting in fresh pages.

Called from the mains (md4jax.main, benchmarks/) only, when config.reuse_freed_host_memory
is set: it changes the whole process.
"""

import ctypes
import ctypes.util
import os


def _on_accelerator_host() -> bool:
  return any(os.path.exists(path) for path in ("/dev/accel0", "/dev/vfio/0", "/dev/nvidia0"))


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
# The largest value mallopt takes (a C int): blocks from 2 GiB up are still mapped fresh.
MMAP_THRESHOLD_BYTES = 2**31 - 1


def reuse_freed_host_memory() -> bool:
  """Makes glibc keep freed memory for reuse instead of unmapping it; True if it applied.

  XLA:CPU allocates an execution's temporaries afresh every call. Above glibc's mmap
  threshold (at most 32 MB, and any size beyond a thread arena's 64 MB heap) each is a
  fresh mmap whose every page faults on first touch, so a small model's step spends much
  of its CPU time in the kernel. One arena that never trims and maps only the largest
  blocks (below) hands the same pages back each call.
  The cost is memory: small allocations split the freed temporaries, so the heap grows
  by about one temporary per call until enough holes exist, and then stays larger than it
  would be without reuse; hence opt-in per config. Blocks of MMAP_THRESHOLD_BYTES (2 GiB)
  and more are still mapped fresh and unmapped when freed, so the heap never keeps them: at
  12 layers/768 a heap that kept every block outgrew the host's memory. Measured costs and
  gains: docs/performance.md, "Host memory".
  Only for CPU compute (not on TPU or GPU hosts, whose many host threads want their
  own arenas) and only where the C library is glibc; must run before JAX starts its
  threads.
  """
  if _on_accelerator_host():
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    mallopt = libc.mallopt
  except (OSError, AttributeError, TypeError):  # Not glibc (macOS, musl): nothing to tune.
    return False
  return all(
    mallopt(param, value) == 1
    for param, value in (
      (_M_ARENA_MAX, 1),
      (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
      (_M_TRIM_THRESHOLD, 2**31 - 1),
    )
  )
