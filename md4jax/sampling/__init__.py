"""Reverse-process samplers over any denoiser, and generation from a trained workdir."""
