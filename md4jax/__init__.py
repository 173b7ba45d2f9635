"""md4jax: masked (absorbing-state) discrete diffusion language models in JAX."""

__version__ = "0.1.0"
