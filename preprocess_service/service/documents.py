"""A job's documents: its datasets' shards, read and parsed with each dataset's settings; the
DocumentSource the core planner reads through (core/planner.py).

Around the planner's reads it decides what the core must not know: which parsed documents keep
their encoded bytes until they are decoded (a MediaRetention: the memory budget's policy), and a
shard's img2dataset side files (its failed downloads, reported when a pass starts the shard).

Plans from manifests: a local shard whose img2dataset parquet is plain (every successful row one
image and a caption with its stored size: ``Manifest.plannable``) is planned from the parquet.
Its samples are the parquet's successful rows, in order, their text the ``caption`` column; each
image is sized and oriented by its header, read by offset (ShardReader.iter_heads: a manifest
cannot know an EXIF orientation, and its size may be wrong; parse.KnownImage). The rest of the
tar is read when a planned sample is decoded, by its members' offsets (ShardReader.read_samples).
Other shards are read as tars.
Skipped samples go to the sink it was made with (the job's report, or a replica's batch for Redis)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from disttrain_api.config import MODALITIES, DatasetConfig, JobConfig
from disttrain_api.errors import ConfigError, DataQualityError, SampleError
from preprocess_service.adapters.io import img2dataset, shards, sources
from preprocess_service.adapters.media import image_heads
from preprocess_service.adapters.media import tokenizers as text_tokenizers
from preprocess_service.adapters.media.parse import KnownImage, classify_members, parse_document
from preprocess_service.adapters.plugins.hooks import HookCosts, HookLimits, HookSpec
from preprocess_service.adapters.plugins.host import SampleHooks
from preprocess_service.adapters.plugins.registry import plugin_class
from preprocess_service.core.sample import EPOCH, Document
from preprocess_service.core.shardnames import Concat, ShardNames, as_names
from preprocess_service.core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SkipSink = Callable[[SampleError], None]
FROM_MANIFEST = "__manifest__"
"""Marks a raw sample made from a shard's manifest row: no encoded bytes (read at decode)."""
MANIFEST_PROBLEM = "__manifest_problem__"
"""Why a raw sample made from a manifest row cannot be planned (it is skipped with this reason)."""
REPORT_WAIT_S = 30.0
"""How long a report waits for side files being read."""
DATASET_MEMO = 1 << 16
"""Shards whose dataset a job remembers (those it opened or looked up last)."""
MANIFEST_DEFER_S = 10.0
"""Longest a job defers reading its first shards' img2dataset manifests for its first microbatch."""


def expand_datasets(reader: shards.ShardReader, config: JobConfig) -> list[ShardNames]:
    """Each dataset's checked, normalised shard names (JobConfig.mixture() order; a large pattern
    is held as its pattern, sources.PatternNames). ConfigError for a shard in two datasets (whose
    settings would it take?) or more names in all than the operator's max_shards."""
    out: list[ShardNames] = []
    total = 0
    for dataset in config.mixture():
        urls = reader.expand(dataset.shards)
        total += len(urls)
        if total > reader.policy.max_shards:
            raise ConfigError(f"the datasets expand to more than {reader.policy.max_shards} shards (max_shards)")
        out.append(urls)
    if len(out) > 1:
        _refuse_shared(out, [dataset.name for dataset in config.mixture()])
    return out


def _refuse_shared(names: list[ShardNames], datasets: list[str]) -> None:
    """ConfigError for a shard in two datasets: every name hashed once (a pattern's as spelled:
    ShardNames.quick_names), and only names whose hashes meet compared."""
    hashes = [np.fromiter((hash(url) for url in urls.quick_names()), dtype=np.int64, count=len(urls))
              for urls in names]
    for j in range(1, len(names)):
        for i in range(j):
            for k in np.flatnonzero(np.isin(hashes[j], hashes[i])):
                url = names[j][int(k)]
                if names[i].position(url) is not None:
                    raise ConfigError(f"shard {url!r} is in datasets {datasets[i]!r} and {datasets[j]!r}; "
                                      "a shard belongs to one dataset")


def download_failures(url: str) -> list[SampleError]:
    """The rows img2dataset failed to download for a local shard (its parquet), as download_failed
    problems: reported once per shard and epoch, never in the tar, counted toward no tolerance.
    A manifest that cannot be read is a warning, never the job's end. A shard whose img2dataset
    stats file declares no failure is not read for them (img2dataset.declares_no_failures)."""
    try:
        if not sources.parse(url).is_local or img2dataset.declares_no_failures(url):
            return []
        manifest = img2dataset.read_manifest(url)
        return img2dataset.failed_rows_as_errors(manifest, url) if manifest is not None else []
    except MemoryError:
        raise
    except Exception as exc:  # the parquet is data: its faults are the shard's report, not the job's
        log.warning("shard %s: its img2dataset parquet cannot be used (%s: %s)", url, type(exc).__name__, exc)
        return []


def job_tokenizer(spec: str, policy) -> Tokenizer:
    """The job's tokenizer (media/tokenizers.load_checked); a file that cannot be used is a ConfigError."""
    try:
        return text_tokenizers.load_checked(spec, policy)
    except text_tokenizers.TokenizerError as exc:
        raise ConfigError(str(exc)) from None


def _parse_options(config: JobConfig, dataset: DatasetConfig):
    """(member kinds kept or None for all, ImageConfig, GenerationConfig) of one dataset."""
    modalities = None if set(dataset.modalities) == set(MODALITIES) else frozenset(dataset.modalities)
    generation = dataclasses.replace(config.generation, select=dataset.generate) if dataset.generate \
        else config.generation
    return modalities, dataset.image or config.image, generation


class SideFiles:
    """Reads each shard's img2dataset manifest (its failed downloads) when a pass starts it. Until
    the job's first microbatch is out (or a report is asked for) they are read on a background
    thread instead: pyarrow's import and first read are a large share of a job's start-up."""

    def __init__(self, name: str, on_skip: SkipSink, defer: bool = True):
        self.name, self.on_skip = name, on_skip
        self.first_out = threading.Event()
        """Set when the job's first microbatch is decoded: deferred manifests wait for it."""
        self._lock = threading.Condition()
        self._deferred: list[str] = []
        self._reading = 0
        self._deferring = defer

    def shard_started(self, url: str) -> None:
        with self._lock:
            if self._deferring:
                self._deferred.append(url)
                if len(self._deferred) == 1:  # the first: one thread reads them all
                    threading.Thread(target=self._read_deferred, daemon=True, name=f"manifests:{self.name}").start()
                return
        for problem in download_failures(url):
            self.on_skip(problem)

    def _read_deferred(self) -> None:
        self.first_out.wait(MANIFEST_DEFER_S)
        self.flush()

    def flush(self, timeout_s: float = REPORT_WAIT_S) -> None:
        """Reads the deferred manifests (and stops deferring); returns once they are reported,
        whoever reads them (or after ``timeout_s``)."""
        while True:
            with self._lock:
                self._deferring = False
                if not self._deferred:
                    self._lock.wait_for(lambda: self._reading == 0, timeout_s)
                    return
                url = self._deferred.pop(0)
                self._reading += 1
            try:
                for problem in download_failures(url):
                    self.on_skip(problem)
            finally:
                with self._lock:
                    self._reading -= 1
                    self._lock.notify_all()


def sample_hooks(config: JobConfig, limits: HookLimits,
                 on_costs: Callable[[HookCosts], None] | None = None) -> SampleHooks | None:
    """The worker that runs ``config``'s sample hooks, or None if none of its plugins has one;
    ``on_costs`` is told what they spend on each sample."""
    plugins = tuple(p for p in config.plugins if plugin_class(p.name).has_sample_hook())
    return SampleHooks(HookSpec(plugins, config.seed, 0, limits), on_costs) if plugins else None


def _manifest_samples(reader: shards.ShardReader, url: str, manifest: img2dataset.Manifest, first: int,
                      on_problem: SkipSink) -> Iterator[dict]:
    """Raw samples of a shard's manifest rows from ``first`` on: key, caption, and each image member
    as the manifest declares its size beside its first and last bytes, read by offset (the header
    decides its size and orientation: KnownImage). A row the tar does not hold is a sample that
    fails (MANIFEST_PROBLEM), so every row counts as one sample, as when resuming."""
    heads = reader.iter_heads(url, manifest.keys[first:], on_problem, head_bytes=image_heads.HEAD_BYTES,
                              wanted=lambda suffix: classify_members({suffix: b""}).get(suffix) == "image",
                              enough=image_heads.header_fits)
    for i, (key, members) in enumerate(heads, first):
        caption = manifest.captions[i] or ""
        sample: dict = {"__key__": key, "__url__": url, "txt": caption.encode("utf-8", "replace"), FROM_MANIFEST: True}
        if members is None:
            sample[MANIFEST_PROBLEM] = "its manifest row says it was downloaded, but the tar does not hold it"
        for suffix, head in (members or {}).items():
            declared_w, declared_h = int(manifest.width[i]), int(manifest.height[i])
            sample[suffix] = KnownImage(declared_w, declared_h, head.size, head.head, head.tail)
        yield sample


@dataclass
class JobDocuments:
    """The job's DocumentSource: its datasets' shards through ``reader``, parsed with the settings
    of the dataset a shard belongs to; ``keep(doc)`` decides whether a document planned now keeps
    its encoded bytes (else they are dropped and re-read when it is decoded)."""

    config: JobConfig
    reader: shards.ShardReader
    dataset_urls: list[ShardNames]
    tokenizer: Tokenizer
    on_skip: SkipSink
    keep: Callable[[Document], bool] = lambda doc: True
    side_files: SideFiles | None = None
    fingerprint: str = ""
    hooks: SampleHooks | None = None
    """The job's plugins' sample hooks, run on every sample before it is parsed (None: no plugin has one)."""
    _dataset_of: dict[str, int] = field(init=False, repr=False)
    """The dataset of each shard opened or looked up lately (bounded: DATASET_MEMO)."""
    _options: list = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.dataset_urls = [as_names(urls) for urls in self.dataset_urls]
        self._dataset_of = {}
        self._options = [_parse_options(self.config, dataset) for dataset in self.config.mixture()]

    def with_sink(self, on_skip: SkipSink, keep: Callable[[Document], bool], side_files: SideFiles | None):
        """The same documents, reporting and holding bytes elsewhere (a replica's planner)."""
        return dataclasses.replace(self, on_skip=on_skip, keep=keep, side_files=side_files)

    @property
    def shard_urls(self) -> ShardNames:
        """Every dataset's shard names, one after the other (a view)."""
        return Concat(self.dataset_urls)

    def iter_shard(self, url: str, on_problem: SkipSink, start: dict | None = None,
                   dataset: int | None = None) -> Iterator[dict]:
        if dataset is not None:  # the planner says whose shard it opens (else it is looked up)
            self._remember(url, dataset)
        if start is None:
            self._shard_started(url)
        manifest = self.manifest(url)
        if manifest is not None:
            return _manifest_samples(self.reader, url, manifest, int((start or {}).get("samples", 0)), on_problem)
        return self.reader.iter_shard(url, on_problem, start)

    def manifest(self, url: str) -> img2dataset.Manifest | None:
        """The shard's img2dataset manifest if the shard is planned from it (module docstring)."""
        if self.config.manifests == "off" or self.hooks is not None:  # sample hooks see whole samples
            return None
        manifest = img2dataset.read_manifest(url)
        return manifest if manifest is not None and manifest.plannable else None

    def read_samples(self, url: str, keys: set[str]) -> dict[str, dict]:
        return self.reader.read_samples(url, keys)

    def shard_keys(self, url: str, limit: int | None = None) -> Iterator[str]:
        manifest = self.manifest(url)
        if manifest is not None:
            return iter(manifest.keys[:limit])
        return self.reader.shard_keys(url, limit)

    def skipped(self, problem: SampleError) -> None:
        self.on_skip(problem)

    def parse(self, sample: dict) -> Document:
        """A Document of ``sample`` with its dataset's settings, holding its bytes if ``keep`` says so."""
        doc = self.parse_only(sample)
        if sample.get(FROM_MANIFEST) or (doc.media_bytes is not None and not self.keep(doc)):
            doc.media_bytes = None
        return doc

    def parse_only(self, sample: dict) -> Document:
        """A Document of ``sample`` with the settings of the dataset its shard belongs to."""
        url = sample.get("__url__", "")
        dataset = self._dataset(url)
        if dataset is None:  # a plan or a record naming a shard the job does not have: data too
            raise SampleError(sample.get("__key__", ""), f"shard {url!r} is not one of this job's", url, "shard_error")
        if MANIFEST_PROBLEM in sample:
            raise SampleError(sample["__key__"], sample[MANIFEST_PROBLEM], url, "shard_error")
        modalities, image, generation = self._options[dataset]
        if self.hooks is not None:
            sample = self.hooks.apply(sample, int(sample.get(EPOCH, 0)))
        doc = parse_document(sample, image_config=image, tokenizer=self.tokenizer, seq_len=self.config.seq_len,
                             audio_config=self.config.audio, generation=generation, modalities=modalities,
                             video_config=self.config.video)
        doc.dataset = dataset
        return doc

    def _remember(self, url: str, dataset: int) -> None:
        if len(self._dataset_of) >= DATASET_MEMO:
            self._dataset_of.clear()
        self._dataset_of[url] = dataset

    def _dataset(self, url: str) -> int | None:
        """The dataset ``url`` belongs to: the planner said so when it opened the shard, or it is
        looked up in the datasets' names (a plan record or a replica's read; the first lookup in
        a large pattern names all its shards once)."""
        dataset = self._dataset_of.get(url)
        if dataset is None and isinstance(url, str):
            dataset = next((i for i, names in enumerate(self.dataset_urls) if names.position(url) is not None), None)
            if dataset is not None:
                self._remember(url, dataset)
        return dataset

    def _shard_started(self, url: str) -> None:
        """The shard's side files, fault-isolated: what they hold is data too."""
        try:
            if self.side_files is not None:
                self.side_files.shard_started(url)
        except (ImportError, MemoryError, DataQualityError):
            raise
        except Exception as exc:
            self.on_skip(SampleError("", f"could not read the shard's side files ({type(exc).__name__}: "
                                     f"{str(exc)[:200]})", url, "shard_error"))
