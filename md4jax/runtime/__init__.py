"""Where a run lives: the device mesh and its shardings, the workdir layout, host memory."""
