"""Evaluation as the paper reports it: per-benchmark avg@n, pass@k and maj@n from every sample (``evaluate``)."""

from stare_lightning.evaluation.report import all_results, benchmark_results, markdown_table

__all__ = ["all_results", "benchmark_results", "markdown_table"]
