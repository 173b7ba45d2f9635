"""The application layer: workdirs and md4jax.load, the CLI's modes, the harness, reports, plots and
cost accounting."""
