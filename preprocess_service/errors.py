"""The domain error hierarchy; the gRPC edge maps each class to a status code."""

from __future__ import annotations


class DisttrainError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(DisttrainError, ValueError):
    """A job spec or request is invalid (gRPC INVALID_ARGUMENT)."""


class NotFoundError(DisttrainError, LookupError):
    """A job, step or rank that does not exist (gRPC NOT_FOUND / OUT_OF_RANGE)."""


class SampleError(DisttrainError):
    """One sample cannot be used; it is skipped and reported, the stream goes on."""

    KINDS = ("invalid_json", "bad_utf8", "unreadable_image", "truncated_image", "decompression_bomb",
             "unreadable_audio", "invalid_order", "too_long", "empty", "decode_failed", "decode_worker_died",
             "shard_error")
    """Short machine-readable causes, for counting; ``reason`` is the sentence for people."""

    def __init__(self, key: str, reason: str, shard: str = "", kind: str = "decode_failed"):
        assert kind in self.KINDS, kind
        super().__init__(f"sample {key!r}: {reason}")
        self.key = key
        self.reason = reason
        self.shard = shard
        self.kind = kind


class ServiceUnavailableError(DisttrainError, ConnectionError):
    """Something this process needs cannot be reached: the service (from a client), Redis (from a
    replica). gRPC UNAVAILABLE."""


class StreamSuperseded(DisttrainError):
    """A newer stream of the same rank started (on any replica); the older one stops (gRPC ABORTED)."""


class FeedbackDisabled(DisttrainError):
    """Timings reported for a job that did not ask for cost feedback (gRPC FAILED_PRECONDITION)."""
