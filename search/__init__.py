"""search: find the best stable settings for a PyTorch workload on the hardware in front of it."""

from search.workloads.base import ServingWorkload, Workload

__all__ = ["ServingWorkload", "Workload"]
