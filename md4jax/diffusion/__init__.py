"""The diffusion math: masking schedules, the forward process, the NELBO, GenMD4 and the generated language."""
