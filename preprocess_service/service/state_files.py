"""A single node's job states on its disk (``state_dir``): written whole at every acknowledgement,
and written again by themselves once a disk that refused them has room.

A disk that cannot take a state (full, read-only) fails no acknowledgement: the state before stays
whole and a restart resumes there. The state refused is kept (the newest one per job, the newest
``MAX_UNSAVED`` jobs) and one thread writes it again, backing off from ``RETRY_S[0]`` to
``RETRY_S[1]`` seconds, until it lands or the service stops: a job that acknowledged its last step
while the disk was full is not left at an old state once the disk has room."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from preprocess_service.adapters.infra import metrics

log = logging.getLogger(__name__)

RETRY_S = (0.5, 10.0)
MAX_UNSAVED = 1024


class StateFiles:
    """Writes each job's state to its files in ``state_dir`` (StateFiles.saver) and writes a refused
    one again until it lands."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self._lock = threading.Lock()
        self._unsaved: collections.OrderedDict[str, _Saver] = collections.OrderedDict()
        self._wake = threading.Condition(self._lock)
        self._retrying: threading.Thread | None = None
        self._closed = False

    def saver(self, job_id: str, paths: list[Path], state: Callable[[], dict],
              on_failing: Callable[[bool], None]) -> Callable[[int], None]:
        """What a job calls with its lowest acknowledged step: writes ``state()`` to each of
        ``paths``. ``on_failing(True)`` when a write is refused, ``on_failing(False)`` once its
        state is saved again."""
        return _Saver(self, job_id, paths, state, on_failing)

    def num_unsaved(self) -> int:
        """Jobs whose newest state the disk has refused so far."""
        with self._lock:
            return len(self._unsaved)

    def close(self) -> None:
        """Stops writing again (the service stops); what is still unsaved stays so."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            thread = self._retrying
        if thread is not None:
            thread.join(timeout=5)

    def _refused(self, saver: _Saver) -> None:
        with self._lock:
            if self._closed:
                return
            self._unsaved.pop(saver.job_id, None)
            self._unsaved[saver.job_id] = saver  # the newest last: a lineage file ends at its newest state
            while len(self._unsaved) > MAX_UNSAVED:
                _, dropped = self._unsaved.popitem(last=False)
                log.error("job %s: its unsaved state is no longer written again (more than %d jobs wait for the "
                          "disk)", dropped.job_id, MAX_UNSAVED)
            if self._retrying is None:
                self._retrying = threading.Thread(target=self._retry, name="disttrain-state-retry", daemon=True)
                self._retrying.start()
            self._wake.notify_all()

    def _saved(self, saver: _Saver) -> None:
        with self._lock:
            if self._unsaved.get(saver.job_id) is saver:
                del self._unsaved[saver.job_id]

    def _retry(self) -> None:
        wait = RETRY_S[0]
        while True:
            with self._lock:
                self._wake.wait_for(lambda: self._closed or not self._unsaved, timeout=wait)
                if self._closed or not self._unsaved:
                    self._retrying = None
                    return
                pending = list(self._unsaved.values())
            landed = sum(saver.write_again() for saver in pending)
            wait = RETRY_S[0] if landed else min(wait * 2, RETRY_S[1])


class _Saver:
    """One job's state files: writes through a file of its own renamed over each (never half
    written; two jobs of one lineage do not share a temporary file)."""

    def __init__(self, files: StateFiles, job_id: str, paths: list[Path], state: Callable[[], dict],
                 on_failing: Callable[[bool], None]):
        self.files, self.job_id, self.paths = files, job_id, paths
        self._state, self._on_failing = state, on_failing
        self._lock = threading.Lock()
        self._unsaved: tuple[int, str] | None = None
        """The newest state the disk refused, and its acknowledged step."""

    def __call__(self, low: int) -> None:
        with self._lock:
            self._write(low, json.dumps(self._state()))  # the state now: the newest, whatever order calls came in

    def write_again(self) -> bool:
        """Writes the refused state again; True if it landed (or a newer save did meanwhile)."""
        with self._lock:
            if self._unsaved is None:
                return True
            return self._write(*self._unsaved)

    def _write(self, low: int, text: str) -> bool:
        for path in self.paths:
            tmp = path.with_name(f".{path.name}.{self.job_id}.tmp")
            try:
                tmp.write_text(text)
                os.replace(tmp, path)
            except OSError as exc:
                with contextlib.suppress(OSError):  # a read-only disk refuses even this
                    tmp.unlink(missing_ok=True)
                metrics.STATE_SAVE_ERRORS.labels(self.job_id).inc()
                if self._unsaved is None:
                    log.error("job %s: cannot save its state at acknowledged step %d to %s (%s); it goes on, writes "
                              "it again once the disk takes it, and a restart of this service meanwhile resumes "
                              "from the last state saved there", self.job_id, low, path, exc.strerror or exc)
                    self._on_failing(True)
                self._unsaved = (low, text)
                self.files._refused(self)
                return False
        if self._unsaved is not None:
            log.warning("job %s: its state is saved again (acknowledged step %d)", self.job_id, low)
            self._unsaved = None
            self._on_failing(False)
            self.files._saved(self)
        return True
