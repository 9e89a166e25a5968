"""Trainer-side library: receive this rank's microbatches from the preprocessing service."""

from trainer.client import Credentials, DataClient, Microbatch
from trainer.data import ParallelLayout, ServiceDataset
from trainer.profiling import CostProfiler

__all__ = ["CostProfiler", "Credentials", "DataClient", "Microbatch", "ParallelLayout", "ServiceDataset"]
