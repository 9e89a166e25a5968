"""Trainer-side library: receive this rank's microbatches from the preprocessing service."""

from trainer.client import Credentials, DataClient, Microbatch
from trainer.data import ParallelLayout, ServiceDataset

__all__ = ["Credentials", "DataClient", "Microbatch", "ParallelLayout", "ServiceDataset"]
