"""Trainer-side library: receive this rank's microbatches from the preprocessing service."""

from trainer.client import DataClient, Microbatch

__all__ = ["DataClient", "Microbatch"]
