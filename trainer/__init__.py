"""Trainer-side library: receive this rank's microbatches from the preprocessing service."""

from trainer.client import Credentials, DataClient, Microbatch

__all__ = ["Credentials", "DataClient", "Microbatch"]
