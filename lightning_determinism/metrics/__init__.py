"""Metrics that stay exact across processes."""

from lightning_determinism.metrics.perplexity import DistributedPerplexity, perplexity

__all__ = ["DistributedPerplexity", "perplexity"]
