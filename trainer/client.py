"""DataClient: an iterator over one DP rank's microbatches, as torch tensors, in planned order.

    client = DataClient("localhost:50051", job_config_or_id, dp_rank=rank, prefetch=4)
    for mb in client:            # Microbatch: tokens, position_ids, images, cu_seqlens, ...
        train(mb)
    ckpt["data"] = client.state_dict()   # a few numbers; load_state_dict() resumes at that point

A background thread reads the gRPC stream into a bounded queue (``prefetch`` microbatches), so
decoding on the server and the copy to torch overlap with training. On the service's own host the
microbatches come in shared memory instead (``shared_memory``, on by default where /dev/shm
exists): the tensors are views of it, with nothing copied and no payload through gRPC. If the stream breaks with a
transient error (the replica died, restarted, or a newer stream took the rank over) the thread
reconnects, to the next of the given addresses, and continues at the first microbatch it does
not have: with several replicas on one Redis every replica streams the same committed plan.

``address`` is one gRPC target ("host:port", or "dns:///name:port" for a name that resolves to
several replicas: gRPC then picks a live one), a comma-separated list of them, or a list.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import logging
import math
import mmap
import os
import queue
import random
import re
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from disttrain_api import heap, lent, wire
from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from disttrain_api.channel import SERVICE_NAME, Credentials, channel_options
from disttrain_api.config import JobConfig
from disttrain_api.errors import ServiceUnavailableError
from disttrain_api.spec import config_from_spec, spec_from_config

log = logging.getLogger(__name__)
WAIT_WINDOW = 32
"""Microbatches data_wait_fraction looks back over."""
WAIT_WARN_FRACTION = 0.2
"""A rank waiting for data more than this share of its time is told (a log warning) that data is the bottleneck."""
WARN_EVERY_S = 60.0


class _WaitMetric:
    """``disttrain_client_data_wait_seconds_total{rank}`` where prometheus_client is installed (the
    trainer's own /metrics exports it); nothing otherwise (the client needs no metrics library).
    Registered on first use: importing the client loads no metrics library."""

    def __init__(self):
        self._counter = None
        self._tried = False

    def counter(self):
        if not self._tried:
            self._tried = True
            try:
                from prometheus_client import Counter
            except ImportError:
                return None
            try:
                self._counter = Counter("disttrain_client_data_wait_seconds", "Seconds a trainer rank waited for "
                                        "its next microbatch from the service (its prefetch queue empty)", ["rank"])
            except ValueError:  # registered already in this process's registry
                pass
        return self._counter

    def add(self, rank: int, seconds: float) -> None:
        counter = self.counter()
        if counter is not None:
            counter.labels(str(rank)).inc(seconds)


_DATA_WAIT = _WaitMetric()
STATE_VERSION = 2
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.ABORTED}
_END = object()
UNAVAILABLE_BACKOFF_S = 0.05
"""First pause between unary tries once every address answered UNAVAILABLE (doubling to 1.6 s)."""
SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"dtmb_[0-9a-f]{8}_[0-9a-f]{24}")


@dataclass(slots=True)
class Microbatch:
    """One microbatch of this rank (S sequences of L tokens; layout documented in the .proto)."""

    step: int
    epoch: int
    microbatch_index: int
    num_microbatches: int
    tokens: torch.Tensor
    """int32 [S, L]"""
    position_ids: torch.Tensor
    modality: torch.Tensor
    """uint8 [S, L]: 0 padding, 1 text, 2 image, 3 audio, 4 query token of an image to generate, 5 video"""
    loss_mask: torch.Tensor
    """uint8 [S, L]: 1 where position i is trained to predict tokens[s, i + 1] (the .proto says when)"""
    labels: torch.Tensor
    """int64 [S, L]: tokens shifted left by one, -100 (cross_entropy's ignore_index) where loss_mask
    is 0; derived here, not sent"""
    cu_seqlens: torch.Tensor
    """int32 [G+1], segment boundaries in the flattened S*L tokens"""
    segment_doc: torch.Tensor
    image_spans: torch.Tensor
    """int32 [N, 2], token span of each image in the flattened S*L tokens"""
    images: list[torch.Tensor]
    """N uint8 [H, W, 3] tensors (views of one buffer)"""
    audio_spans: torch.Tensor
    """int32 [A, 2], token span of each audio clip"""
    mels: list[torch.Tensor]
    """A float16 [frames, n_mels] log-mel tensors (views of one buffer)"""
    gen_spans: torch.Tensor
    """int32 [G, 2], query-token span of each image to generate"""
    gen_images: torch.Tensor
    """uint8 [G, R, R, 3], the generation targets at the job's fixed size"""
    sample_keys: list[str]
    sequence_costs: list[float]
    video_spans: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 2), dtype=torch.int32))
    """int32 [V, 2], token span of each video: frames / temporal_patch x the tokens of one frame"""
    videos: list[torch.Tensor] = field(default_factory=list)
    """V uint8 [frames, H, W, 3] tensors (views of one buffer): the sampled frames of each video"""
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    sample_datasets: list[int] = field(default_factory=list)
    """For a mixture: each sample's dataset (index into the job's datasets); empty otherwise."""
    nbytes: int = 0
    """Payload bytes on the wire."""

    TENSORS = ("tokens", "position_ids", "modality", "loss_mask", "labels", "cu_seqlens", "segment_doc",
               "image_spans", "audio_spans", "gen_spans", "gen_images", "video_spans")

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Microbatch:
        """This microbatch with every tensor on ``device``; from pinned memory (DataClient's
        ``pin_memory``) the copies are asynchronous with ``non_blocking``."""
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking) for name in self.TENSORS}
        return dataclasses.replace(self, **moved, images=[t.to(device, non_blocking=non_blocking) for t in self.images],
                                   mels=[t.to(device, non_blocking=non_blocking) for t in self.mels],
                                   videos=[t.to(device, non_blocking=non_blocking) for t in self.videos])


def to_microbatch(raw: bytes) -> Microbatch:
    """A serialized Microbatch -> torch tensors; each array is copied once out of ``raw``, so the
    tensors are writable and own their memory."""
    return _to_microbatch(*wire.decode_microbatch(raw))


def _to_microbatch(message: pb.Microbatch, arrays: dict[str, np.ndarray], owned: bool = False,
                   pin: bool = False) -> Microbatch:
    """``owned``: the arrays are writable views of memory only this microbatch uses (a shared-memory
    microbatch's mapping), so the tensors view them instead of copying."""
    missing = [name for name in _RECEIVED if name not in arrays]
    if missing:
        raise ValueError(f"the microbatch lacks the tensors {missing} (is the service older than this client?)")
    tensors = {name: torch.from_numpy(a) if owned and not pin else _own(a, pin) for name, a in arrays.items()}
    labels = wire.derive_labels(arrays["tokens"], arrays["loss_mask"])
    return Microbatch(
        step=message.step, epoch=message.epoch, microbatch_index=message.microbatch_index,
        num_microbatches=message.num_microbatches, tokens=tensors["tokens"],
        position_ids=tensors["position_ids"], modality=tensors["modality"], loss_mask=tensors["loss_mask"],
        labels=_own(labels, pin) if pin else torch.from_numpy(labels), cu_seqlens=tensors["cu_seqlens"],
        segment_doc=tensors["segment_doc"], image_spans=tensors["image_spans"],
        images=_split(tensors["pixels"], arrays["image_shapes"].tolist()),
        audio_spans=tensors["audio_spans"],
        mels=list(torch.split(tensors["mel"], arrays["audio_frames"].tolist())),
        gen_spans=tensors["gen_spans"], gen_images=tensors["gen_pixels"],
        **_videos(tensors, arrays),
        sample_keys=list(message.sample_keys), sequence_costs=[c.total_s for c in message.sequence_costs],
        skipped=[(s.key, s.shard, s.reason) for s in message.skipped],
        sample_datasets=list(message.sample_datasets),
        nbytes=sum(a.nbytes for a in arrays.values()),
    )


_RECEIVED = ("tokens", "position_ids", "modality", "loss_mask", "cu_seqlens", "segment_doc", "image_spans",
             "image_shapes", "pixels", "audio_spans", "audio_frames", "mel", "gen_spans", "gen_pixels")


def _own(array: np.ndarray, pin: bool) -> torch.Tensor:
    """A tensor that owns a copy of ``array`` (a view of the received bytes), in page-locked memory
    when ``pin``, so the copy to a GPU can be asynchronous."""
    if not pin:
        return torch.from_numpy(array.copy())
    out = torch.empty(array.shape, dtype=torch.from_numpy(array[:0].copy()).dtype, pin_memory=True)
    out.numpy()[...] = array
    return out


def _from_shared_memory(header: pb.Microbatch) -> tuple[pb.Microbatch, dict[str, np.ndarray], bool]:
    """A shared-memory microbatch (Microbatch.shm_name): mapped, unlinked (it is ours now), parsed;
    the arrays are writable views of the mapping, which lives as long as they do. A lent one
    (shm_token) is mapped and locked, not unlinked (_borrow). FileNotFoundError: it is gone."""
    name, nbytes = header.shm_name, header.shm_nbytes
    if not _SHM_NAME.fullmatch(name) or not 0 < nbytes <= wire.MAX_SHARED_BYTES:
        raise ValueError(f"the service named an invalid shared-memory microbatch {name!r} ({nbytes} bytes)")
    if header.shm_token:
        return _borrow(header)
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        os.unlink(path)
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"shared-memory microbatch {name} holds fewer than its {nbytes} bytes")
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)  # no MAP_POPULATE: see _borrow
    finally:
        os.close(fd)
    message, arrays = wire.decode_microbatch(memoryview(mapping))
    return message, arrays, True


def _borrow(header: pb.Microbatch) -> tuple[pb.Microbatch, dict[str, np.ndarray], bool]:
    """A lent microbatch: the service's decode buffer, which it reuses once we let go. We hold a
    shared flock on it for as long as any of its arrays lives (the descriptor closes with the
    last of them), check its token (a reused one is gone: FileNotFoundError, as for an unlinked
    one) and mark it taken."""
    name, nbytes, token = header.shm_name, header.shm_nbytes, header.shm_token
    if len(token) != lent.TOKEN_BYTES or nbytes <= lent.TAKEN_AT:
        raise ValueError(f"the service lent {name!r} with a {len(token)}-byte token and {nbytes} bytes")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # the service is taking it back: it was abandoned
            raise FileNotFoundError(f"lent microbatch {name} is being reused") from None
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"lent microbatch {name} holds fewer than its {nbytes} bytes")
        # Not populated: a consumer that reads every page pays the same either way (measured), one
        # that reads some (tokens only, or tensors it moves later) pays for those alone.
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        root = np.frombuffer(mapping, dtype=np.uint8)
        if root[:lent.TOKEN_BYTES].tobytes() != token:
            raise FileNotFoundError(f"lent microbatch {name} was reused before it was taken")
        arrays = wire.lent_views(header, root)
        root[lent.TAKEN_AT] = 1
    except BaseException:
        os.close(fd)  # the lock goes with it (a mapping made here goes with its last view)
        raise
    weakref.finalize(root, os.close, fd)  # every array views root: the last one gone lets the service reuse it
    header.ClearField("tensors")  # their arrays are made: the rest of the message is as a copied one's
    return header, arrays, True


def _make_probe() -> tuple[str, bytes, str | None]:
    """(name, token, path) of a new probe object proving this process shares the server's
    /dev/shm (StreamRequest.shm_probe); ("", b"", None) where there is none."""
    if not os.path.isdir(SHM_DIR):
        return "", b"", None
    # the pid first (a process's own probes are findable: tests, cleanup), then 128 random bits
    name, token = f"dtprobe_{os.getpid():08x}{secrets.token_hex(16)}", secrets.token_bytes(32)
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, token)
        finally:
            os.close(fd)
    except OSError:
        return "", b"", None
    return name, token, path


def _drop_probe(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _split(flat: torch.Tensor, shapes: list[list[int]]) -> list[torch.Tensor]:
    sizes = [math.prod(shape) for shape in shapes]
    return [chunk.view(*shape) for chunk, shape in zip(torch.split(flat, sizes), shapes)]


def _videos(tensors: dict[str, torch.Tensor], arrays: dict[str, np.ndarray]) -> dict:
    """The video fields, from a service that sends them (an older one does not: none then)."""
    if "video_spans" not in tensors:
        return {}
    return {"video_spans": tensors["video_spans"],
            "videos": _split(tensors["video_pixels"], arrays["video_shapes"].tolist())}


def _pushback_s(exc: grpc.RpcError) -> float:
    """The server's retry hint (grpc-retry-pushback-ms), capped; 1 s when it gave none."""
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-retry-pushback-ms":
            try:
                return min(30.0, max(0.05, int(value) / 1000))
            except ValueError:
                break
    return 1.0


def next_position(mb) -> tuple[int, int]:
    """(step, microbatch index) after ``mb`` (a Microbatch or a wire header): after a step's last
    microbatch, the next step's first, so that a stream resumed there never names a step whose
    plan the service dropped once every rank acknowledged it."""
    if mb.microbatch_index + 1 >= mb.num_microbatches:
        return mb.step + 1, 0
    return mb.step, mb.microbatch_index + 1


class _Link:
    """A channel to one of the addresses; connect() moves it to the next reachable one. Each link
    has one owner (the stream thread, or the unary calls under a lock), so closing a channel never
    cuts a call someone else has open on it."""

    def __init__(self, addresses: list[str], start: int = -1, credentials: Credentials | None = None,
                 options: list | None = None):
        self.addresses = addresses
        self.index = start
        self.channel = None
        self.credentials = credentials or Credentials()
        self.options = options

    @property
    def address(self) -> str:
        return self.addresses[self.index]

    def connect(self, timeout_s: float, cancelled=lambda: False) -> None:
        """Connects to the first reachable address after the current one, trying them in turn."""
        deadline = time.monotonic() + timeout_s
        while True:
            for _ in range(len(self.addresses)):
                self.index = (self.index + 1) % len(self.addresses)
                self.close()
                self.channel = self.credentials.channel(self.address, self.options)
                wait = max(0.2, min(2.0, deadline - time.monotonic()) / len(self.addresses))
                try:
                    grpc.channel_ready_future(self.channel).result(timeout=wait)
                except grpc.FutureTimeoutError:
                    continue
                self.stub = pb_grpc.PreprocessStub(self.channel)
                self.stream = self.channel.unary_stream(
                    f"/{SERVICE_NAME}/StreamMicrobatches", request_serializer=pb.StreamRequest.SerializeToString,
                    response_deserializer=None)
                return
            if time.monotonic() >= deadline or cancelled():
                self.close()
                raise ServiceUnavailableError(
                    f"cannot reach the preprocessing service at {', '.join(map(repr, self.addresses))} within "
                    f"{timeout_s:g} s (is it running, and is the address right?)")

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class DataClient:
    """Iterates over ``dp_rank``'s microbatches of a job, from the saved position onwards.

    ``job`` is a JobConfig (the job is opened, or joined if open) or the id of an open job.
    Raises ServiceUnavailableError when no address can be reached within ``connect_timeout_s``,
    or, once running, when the stream or a call (acknowledge, status) cannot reach a service again
    within ``reconnect_timeout_s`` of its failure.
    """

    def __init__(self, address: str | Sequence[str], job: JobConfig | str, dp_rank: int, *, prefetch: int = 4,
                 connect_timeout_s: float = 10.0, reconnect_timeout_s: float = 60.0,
                 credentials: Credentials | None = None, keepalive_s: float = 2.0, call_timeout_s: float = 20.0,
                 message_timeout_s: float = 900.0, pin_memory: bool = False, shared_memory: bool = True):
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        heap.tune_malloc()  # each microbatch is copied into fresh torch tensors: reuse heap pages
        self.addresses = [a.strip() for a in (address.split(",") if isinstance(address, str) else address)
                          if a.strip()]
        if not self.addresses:
            raise ValueError("no service address given")
        self.dp_rank = dp_rank
        self.prefetch = prefetch
        self.pin_memory = pin_memory and torch.cuda.is_available()
        """Copy each microbatch into page-locked memory in the background thread (for non_blocking
        copies to a GPU: ``Microbatch.to``). Only where CUDA is available; else a no-op."""
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.call_timeout_s = call_timeout_s
        """Deadline of every unary call; past it the call is retried on the next address."""
        self.shared_memory = shared_memory
        """Offer same-host delivery; the service uses it when it is on this host (decode/shm.py)."""
        self.num_shared_memory = 0
        """Microbatches received in shared memory."""
        self.message_timeout_s = message_timeout_s
        """A stream that delivers nothing for this long (a live but stuck replica) is cancelled and
        resumed elsewhere; a stopped or unreachable one is found sooner, by keepalive pings (every
        ``keepalive_s``, each given as long to answer: a cut link is found in 2-4 s by default; the
        service takes pings up to once a second)."""
        self._options = channel_options(keepalive_s, min(5.0, keepalive_s))
        self._last_progress: float | None = None
        self._stalled = False
        self.num_reconnects = 0
        self.resumed_at: list[float] = []
        """time.monotonic() of the first microbatch received after each reconnect."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._call = None
        self._probe: str | None = None
        """Path of this stream's shared-memory probe until the server has read it."""
        self._stream_link: _Link | None = None
        self.credentials = credentials if credentials is not None else Credentials.from_env()
        self._control = _Link(self.addresses, credentials=self.credentials, options=self._options)  # unary calls
        self._control_lock = threading.Lock()
        self._control.connect(connect_timeout_s)
        self._job = job
        self.info = self._unary(lambda stub: self._open(stub, job))
        self.job_id = self.info.job_id
        self.dp_size = self.info.spec.dp_size
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside the job's dp_size {self.dp_size}")
        self._next = (0, 0)  # (step, microbatch index) of the next microbatch to hand out
        self.data_wait_s = 0.0
        """Seconds this rank has waited for data in ``next()`` (its queue empty) since the client was made."""
        self._window: collections.deque[tuple[float, float]] = collections.deque(maxlen=WAIT_WINDOW)
        self._returned_at: float | None = None
        self._warned_at = -float("inf")

    @property
    def address(self) -> str:
        """The address the stream uses now (before iterating: the one unary calls use)."""
        return (self._stream_link or self._control).address

    def _unary(self, call, *, reopen: bool = False):
        """A unary call, moved to the next address while the current one is unreachable. With
        ``reopen`` and a client made with the job's JobConfig (not its id), a service that does not
        know the job (NOT_FOUND: a single node restarted, a Redis that lost it) gets it opened
        again, once, and the call is made again (a node that keeps the job's state in state_dir
        resumes it there). A job a client closed is FAILED_PRECONDITION, never opened again.

        UNAVAILABLE (a node down, restarting, or bound but still starting) is retried until
        ``reconnect_timeout_s`` (at least ``connect_timeout_s``) from the first failure, as the
        stream waits, backing off (from UNAVAILABLE_BACKOFF_S, doubling, jittered) once every
        address has said so; the other retryable codes get 2 x addresses tries."""
        with self._control_lock:
            reopened = False
            failing_since = None
            tries = waits = 0  # failures of the other retryable codes; UNAVAILABLE ones
            while True:
                try:
                    if reopened is None:  # the job is opened again first (retried like any call)
                        self._open(self._control.stub, self._job)
                        reopened = True
                    return call(self._control.stub)
                except grpc.RpcError as exc:
                    if reopen and reopened is False and exc.code() == grpc.StatusCode.NOT_FOUND \
                            and isinstance(self._job, JobConfig):
                        log.info("%s does not know job %s: opening it again", self._control.address, self.job_id)
                        reopened = None
                        continue
                    now = time.monotonic()
                    failing_since = failing_since or now
                    left = max(self.connect_timeout_s, self.reconnect_timeout_s) - (now - failing_since)
                    unavailable = exc.code() == grpc.StatusCode.UNAVAILABLE
                    if unavailable:
                        waits += 1
                    else:
                        tries += 1
                    if exc.code() not in _RETRYABLE or (left <= 0 if unavailable else tries >= 2 * len(self.addresses)):
                        raise
                    if waits <= len(self.addresses) or waits % 10 == 0:
                        log.info("call to %s failed: %s %s; trying the next address", self._control.address,
                                 exc.code().name, exc.details())
                    if unavailable and waits > len(self.addresses):  # every address said so: back off
                        time.sleep(min(UNAVAILABLE_BACKOFF_S * 2 ** min(waits - len(self.addresses), 5), left)
                                   * random.uniform(0.5, 1.0))
                    # a service gone mid-run (a single node restarting) is waited for as a stream
                    # waits: up to reconnect_timeout_s from the first failure
                    self._control.connect(max(self.connect_timeout_s, left))

    def _open(self, stub, job: JobConfig | str) -> pb.JobInfo:
        if isinstance(job, JobConfig):
            return stub.OpenJob(pb.OpenJobRequest(spec=spec_from_config(job)), timeout=self.call_timeout_s)
        return stub.DescribeJob(pb.DescribeJobRequest(job_id=job), timeout=self.call_timeout_s)

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this rank is: the next (step, microbatch) it has not been handed (a few numbers)."""
        return {"version": STATE_VERSION, "job_id": self.job_id, "lineage": self.lineage_id, "dp_size": self.dp_size,
                "dp_rank": self.dp_rank, "next_step": self._next[0], "next_microbatch": self._next[1]}

    @property
    def lineage_id(self) -> str:
        """The job's lineage (JobConfig.lineage_id): jobs that plan the same sequences in another layout."""
        return config_from_spec(self.info.spec).lineage_id()

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved position. The same job and rank continue where this rank stood.
        Another layout of the same lineage (elastic resume: the job restarted with fewer or more
        ranks, the service continuing the old job's state) continues at the saved step, which must
        be a step boundary (a checkpoint between steps, as a trainer saves it). ValueError otherwise."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict() must be called before iterating")
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"data client state has version {state.get('version')!r}, expected {STATE_VERSION}")
        same_job = state["job_id"] == self.job_id
        if not same_job:
            if state.get("lineage") != self.lineage_id:
                raise ValueError(f"data client state was saved with job_id={state['job_id']!r} but this client has "
                                 f"job_id={self.job_id!r}, and the jobs plan different data (not one lineage); restore "
                                 "into the same job, or one that differs in its layout only (dp_size, microbatches)")
            if int(state["next_microbatch"]) != 0:
                raise ValueError(f"data client state stands inside step {state['next_step']} (microbatch "
                                 f"{state['next_microbatch']}): only a state saved between steps moves to another "
                                 f"layout (dp_size {state['dp_size']} -> {self.dp_size})")
            if int(state["next_step"]) and isinstance(self._job, JobConfig):  # the service continues the lineage
                request = pb.OpenJobRequest(spec=spec_from_config(self._job), continue_at_step=int(state["next_step"]))
                try:
                    self.info = self._unary(lambda stub: stub.OpenJob(request, timeout=self.call_timeout_s))
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE):
                        raise
                    raise ValueError(f"the service cannot continue this job's lineage at step {state['next_step']}: "
                                     f"{exc.details()}") from None
        elif state["dp_rank"] != self.dp_rank:
            raise ValueError(f"data client state was saved with dp_rank={state['dp_rank']!r} but this client has "
                             f"dp_rank={self.dp_rank!r}; restore into the same job and rank")
        self._next = (int(state["next_step"]), int(state["next_microbatch"]))

    # --- iteration ---------------------------------------------------------------------------
    def __iter__(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._receive, name=f"dataclient-r{self.dp_rank}", daemon=True)
            self._thread.start()
        return self

    def __next__(self) -> Microbatch:
        if self._thread is None:
            iter(self)
        asked = time.monotonic()
        item = self._queue.get()
        self._waited(asked, time.monotonic())
        if item is _END:
            self._queue.put(_END)  # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        mb = item if isinstance(item, Microbatch) else _to_microbatch(*item)
        self._next = next_position(mb)
        return mb

    def _waited(self, asked: float, got: float) -> None:
        """Books the wait of one ``next()``; warns (at most every WARN_EVERY_S) when over the last
        WAIT_WINDOW microbatches the rank spent more than WAIT_WARN_FRACTION of its time waiting."""
        wait = got - asked
        self.data_wait_s += wait
        _DATA_WAIT.add(self.dp_rank, wait)
        if self._returned_at is not None:
            self._window.append((wait, got - self._returned_at))
        self._returned_at = got
        fraction = self.data_wait_fraction
        if len(self._window) == self._window.maxlen and fraction > WAIT_WARN_FRACTION \
                and got - self._warned_at > WARN_EVERY_S:
            self._warned_at = got
            log.warning("rank %d waited for data %.0f%% of its last %d microbatches (%.2f s of %.2f s): data is the "
                        "bottleneck (more decode workers or replicas, or a larger prefetch, would help)",
                        self.dp_rank, 100 * fraction, len(self._window), sum(w for w, _ in self._window),
                        sum(t for _, t in self._window))

    @property
    def data_wait_fraction(self) -> float:
        """Share of the time between the last WAIT_WINDOW ``next()`` calls spent waiting for data
        (0: the data was always ready; near 1: training waits on the service)."""
        total = sum(t for _, t in self._window)
        return sum(w for w, _ in self._window) / total if total > 0 else 0.0

    def acknowledge(self, next_step: int | None = None) -> int:
        """Tells the service every step before ``next_step`` (default: this client's position) is trained."""
        request = pb.AckRequest(job_id=self.job_id, dp_rank=self.dp_rank,
                                next_step=self._next[0] if next_step is None else next_step)
        return self._unary(lambda stub: stub.Acknowledge(request, timeout=self.call_timeout_s),
                           reopen=True).min_next_step

    def report_timings(self, timings: list[tuple[int, int, float, float, float]],
                       bubble: tuple[int, float] | None = None) -> pb.TimingAck:
        """Sends measured (step, microbatch_index, encoder_s, backbone_s, generator_s) of this rank's
        microbatches (forward + backward seconds), and optionally (step, measured bubble fraction)
        for the service's metrics; the job must have cost_feedback on."""
        request = pb.TimingReport(job_id=self.job_id, timings=[
            pb.MicrobatchTiming(step=step, dp_rank=self.dp_rank, microbatch_index=index, encoder_s=enc,
                                backbone_s=bb, generator_s=gen) for step, index, enc, bb, gen in timings])
        if bubble is not None:
            request.bubble_step, request.bubble_fraction, request.has_bubble = bubble[0], bubble[1], True
        return self._unary(lambda stub: stub.ReportTimings(request, timeout=self.call_timeout_s), reopen=True)

    def report_totals(self, timings: list[tuple[int, int, float]]) -> pb.TimingAck:
        """Sends measured (step, microbatch_index, seconds) of this rank's microbatches: forward +
        backward of the whole model, for a model not timed per module (CostProfiler sends these).
        The service fits its cost model's coefficients to them jointly; the job must have
        cost_feedback on."""
        request = pb.TimingReport(job_id=self.job_id, timings=[
            pb.MicrobatchTiming(step=step, dp_rank=self.dp_rank, microbatch_index=index, total_s=seconds)
            for step, index, seconds in timings])
        return self._unary(lambda stub: stub.ReportTimings(request, timeout=self.call_timeout_s), reopen=True)

    def close_job(self) -> int:
        """Ends the job on the service for every rank (CloseJob); returns the streams it ended."""
        return self._unary(lambda stub: stub.CloseJob(pb.CloseJobRequest(job_id=self.job_id),
                                                      timeout=self.call_timeout_s)).num_streams_closed

    def report(self) -> pb.JobReport:
        return self._unary(lambda stub: stub.GetReport(pb.ReportRequest(job_id=self.job_id),
                                                       timeout=self.call_timeout_s))

    def _receive(self) -> None:
        position = self._next
        failing_since = None
        try:
            self._stream_link = _Link(self.addresses, start=self._control.index - 1, credentials=self.credentials,
                                      options=self._options)
            threading.Thread(target=self._watch_stream, name=f"dataclient-watch-r{self.dp_rank}", daemon=True).start()
            self._stream_link.connect(self.connect_timeout_s, cancelled=self._stop.is_set)
            while not self._stop.is_set():
                try:
                    lost = False
                    for raw in self._open_stream(position):
                        self._last_progress = time.monotonic()
                        message = wire.decode_microbatch(raw)  # (header, array views of raw)
                        if message[0].shm_name:
                            try:
                                message = _from_shared_memory(message[0])
                            except FileNotFoundError:  # freed under us (the server's stream ended, or
                                lost = True            # someone cleaned /dev/shm): resume right here
                                break
                            self.num_shared_memory += 1
                        if self._probe is not None:  # the server has read it
                            _drop_probe(self._probe)
                            self._probe = None
                        position = next_position(message[0])
                        if failing_since is not None:
                            self.resumed_at.append(time.monotonic())
                            failing_since = None
                        if not self._put(_to_microbatch(*message, pin=True) if self.pin_memory else message):
                            return
                        self._last_progress = time.monotonic()  # a slow consumer is not a stuck server
                    _drop_probe(self._probe)
                    if lost:
                        self._call.cancel()  # its later microbatches are resent from ``position``
                        log.info("a shared-memory microbatch of %s was gone; resuming at %s", self.address, position)
                        failing_since = failing_since or time.monotonic()
                        if time.monotonic() - failing_since > self.reconnect_timeout_s:
                            raise ServiceUnavailableError(f"stream from {self.address!r} kept losing microbatches")
                        self.num_reconnects += 1
                        continue
                    self._put(_END)
                    return
                except grpc.RpcError as exc:
                    _drop_probe(self._probe)
                    log.info("stream from %s failed: %s %s", self.address, exc.code().name, exc.details())
                    if self._stop.is_set():
                        return
                    now = time.monotonic()
                    failing_since = failing_since or now
                    # NOT_FOUND: a replica that never saw the job and a Redis that lost it; open it again
                    reopen = exc.code() == grpc.StatusCode.NOT_FOUND and isinstance(self._job, JobConfig)
                    stalled, self._stalled = self._stalled, False  # cancelled by _watch_stream: move on
                    if (exc.code() not in _RETRYABLE and not reopen and not stalled) \
                            or now - failing_since > self.reconnect_timeout_s:
                        raise ServiceUnavailableError(
                            f"stream from {self.address!r} failed ({exc.code().name}: {exc.details()})") from exc
                    self.num_reconnects += 1
                    if reopen:  # on the replica that does not know the job (with Redis, any would do)
                        try:
                            self._open(self._stream_link.stub, self._job)
                        except grpc.RpcError:
                            self._stream_link.connect(max(1.0, self.reconnect_timeout_s - (now - failing_since)),
                                                      cancelled=self._stop.is_set)
                        time.sleep(0.2)
                    elif exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the server asked to come back later
                        self._stop.wait(_pushback_s(exc))
                    else:
                        self._stream_link.connect(max(1.0, self.reconnect_timeout_s - (now - failing_since)),
                                                  cancelled=self._stop.is_set)
        except BaseException as exc:  # handed to the consumer
            self._put(exc)

    def _watch_stream(self) -> None:
        """Cancels the stream when it has delivered nothing for message_timeout_s (the consumer
        not reading counts as progress: a full queue is not the server's fault)."""
        while not self._stop.wait(min(1.0, self.message_timeout_s / 4)):
            since, call = self._last_progress, self._call
            if since is None or call is None or self._queue.full():
                continue
            if time.monotonic() - since > self.message_timeout_s:
                self._stalled = True
                self._last_progress = None
                call.cancel()

    def _open_stream(self, position: tuple[int, int]):
        """The stream as serialized messages: parsed by wire.decode_microbatch without protobuf's copies."""
        self._last_progress = time.monotonic()
        step, index = position
        _drop_probe(self._probe)
        name, token, self._probe = _make_probe() if self.shared_memory else ("", b"", None)
        self._call = self._stream_link.stream(pb.StreamRequest(
            job_id=self.job_id, dp_rank=self.dp_rank, start_step=step, start_microbatch=index, shm_probe=name,
            shm_probe_token=token))
        return self._call

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stops the background stream and closes the channels; frees the server's resources."""
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)
        _drop_probe(self._probe)
        if self._stream_link is not None:
            self._stream_link.close()
        with self._control_lock:
            self._control.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
