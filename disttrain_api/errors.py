"""The domain error hierarchy; the gRPC edge maps each class to a status code."""

from __future__ import annotations

import re


class DisttrainError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(DisttrainError, ValueError):
    """A job spec or request is invalid (gRPC INVALID_ARGUMENT)."""


class NotFoundError(DisttrainError, LookupError):
    """A job, step or rank that does not exist (gRPC NOT_FOUND / OUT_OF_RANGE)."""


class JobClosedError(NotFoundError):
    """A job a client closed (CloseJob) here (gRPC FAILED_PRECONDITION): unlike a job this node
    never knew or forgot (a restart), a client must not open it again by itself."""


_OBJECT_ADDRESS = re.compile(r"<([\w.]+ object) at 0x[0-9a-fA-F]+>")
"""A default repr in a library's error text (Pillow and libsndfile name the buffer they read): left
out of a reason, so a sample's reason is the same in every process and every decode."""


def repeatable(text: str) -> str:
    """``text`` without the object addresses a library's error text may hold."""
    return _OBJECT_ADDRESS.sub(r"<\1>", text)


class SampleError(DisttrainError):
    """One sample cannot be used; it is skipped and reported, the stream goes on."""

    KINDS = ("invalid_json", "bad_utf8", "unreadable_image", "truncated_image", "decompression_bomb",
             "unreadable_audio", "unreadable_video", "invalid_order", "invalid_conversation", "too_long", "empty",
             "decode_failed",
             "decode_worker_died",
             "shard_error", "truncated_shard", "oversize", "invalid_key", "duplicate_key", "duplicate_member",
             "parse_failed", "read_timeout", "download_failed", "filtered", "plugin_failed")
    """Short machine-readable causes, for counting; ``reason`` is the sentence for people."""
    NOT_LOST = ("duplicate_key", "duplicate_member", "download_failed", "filtered")
    """Kinds that lose nothing the shards hold, so they do not count toward the job's error
    tolerance: a dropped copy (the first copy is delivered), or a row of img2dataset's parquet
    whose URL it could not download or resize (never in the tar; adapters/io/img2dataset.py), or a
    sample an operator's plugin left out on purpose (a filter)."""

    def __init__(self, key: str, reason: str, shard: str = "", kind: str = "decode_failed"):
        assert kind in self.KINDS, kind
        reason = repeatable(reason)
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


class PermissionDenied(DisttrainError, PermissionError):
    """A request names something this service's operator does not allow (a shard scheme or a
    path outside the allowed prefixes; gRPC PERMISSION_DENIED)."""


class ResourceExhausted(DisttrainError):
    """A client asks for more than its share (streams, jobs, memory; gRPC RESOURCE_EXHAUSTED).
    ``retry_after_s`` hints when trying again may succeed."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DataQualityError(DisttrainError):
    """Too many of a job's samples are bad (JobSpec.max_consecutive_errors / max_error_fraction):
    the job fails rather than train on what is left (gRPC DATA_LOSS)."""
