"""The workload contract and the built-in workloads."""

from search.workloads.base import Batch, Workload
from search.workloads.gpt import GPT

__all__ = ["GPT", "Batch", "Workload"]
