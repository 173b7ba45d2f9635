"""md4jax's configs, one module each with a get_config(...) (md4jax.config.load_config and the
programs' --config load them by name, from any directory)."""
