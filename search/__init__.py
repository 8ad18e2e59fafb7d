"""search: find the best stable settings for a PyTorch workload on the hardware in front of it."""

from search.core.errors import SearchError
from search.workloads.base import ServingWorkload, Workload

__all__ = ["SearchError", "ServingWorkload", "Workload"]
