"""Metrics that stay exact across processes: the same bits on any world size and batch split."""

from lightning_determinism.metrics.mean import DistributedMean
from lightning_determinism.metrics.perplexity import DistributedPerplexity, perplexity

__all__ = ["DistributedMean", "DistributedPerplexity", "perplexity"]
