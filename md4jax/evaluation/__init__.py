"""Evaluation: bounds with standard errors, reports, plots and the sample-quality frontier."""
