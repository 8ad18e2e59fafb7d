"""The workload contract and the built-in workloads."""

from search.workloads.base import Batch, ServingWorkload, Workload, is_counting
from search.workloads.gpt import GPT
from search.workloads.gpt_serve import GPTServe
from search.workloads.hf import HF
from search.workloads.llama import Llama
from search.workloads.timm_models import Timm
from search.workloads.vision import TwoBranchCNN

__all__ = [
    "GPT",
    "Batch",
    "GPTServe",
    "HF",
    "Llama",
    "ServingWorkload",
    "Timm",
    "TwoBranchCNN",
    "Workload",
    "is_counting",
]
