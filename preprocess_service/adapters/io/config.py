"""The shard reader's own settings (ReaderConfig): what a shard may make the service read and
how remote shards are fetched and cached. The service's settings compose it (service/settings.py:
``ServiceSettings`` is a ReaderConfig, so each field is also a TOML key, a DISTTRAIN_* variable
and a flag); ``ShardReader.configured`` builds a reader from it. Standard library only: the
service's command line reads settings before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain_api.errors import ConfigError

DEFAULT_SCHEMES = ("file", "http", "https")


def setting(text: str, default=None, **kw):
    """A field with its help text (settings.py turns it into a flag's help)."""
    return field(default=default, metadata={"help": text}, **kw)


@dataclass(kw_only=True, frozen=True)
class ReaderConfig:
    allowed_shard_prefixes: tuple[str, ...] = setting("path or URL prefixes every expanded shard must start with, "
                                                      "compared after normalising (realpath for paths); empty: any", ())
    allowed_shard_schemes: tuple[str, ...] = setting(
        "shard schemes jobs may use: file (local paths), http, https by default; add pipe (runs a shell command "
        "per shard) or gs/s3/... (run programs) only on a trusted deployment", DEFAULT_SCHEMES)
    max_shards: int = setting("most shards one job's specs may expand to (brace patterns are counted before "
                              "they are expanded; a million names take about 100 MB)", 1_000_000)
    max_member_bytes: int = setting("largest tar member read into memory, bytes (checked from the tar header; a "
                                    "larger member skips its sample)", 64 << 20)
    max_sample_bytes: int = setting("largest sum of one sample's tar members, bytes", 128 << 20)
    shard_read_timeout_s: float = setting("seconds a shard may send nothing before it is reported and abandoned "
                                          "(the job goes on); also the timeout of every socket read of a remote "
                                          "shard", 60.0)
    shard_cache_bytes: int = setting("bytes of remote shards (http, https, s3, gs) kept on local disk, so each is "
                                     "downloaded once and re-read locally; least recently used shards not being "
                                     "read are evicted; a shard larger than this is streamed uncached; 0: no cache",
                                     8 << 30)
    shard_cache_dir: str | None = setting("directory under which the server makes its shard cache directory, removed "
                                          "when it exits (unset: the system's temp dir, $TMPDIR or /tmp)")
    shard_fetch_retries: int = setting("failed attempts in a row (no byte received) before a remote shard is "
                                       "reported failed and the job goes on without it", 5)
    shard_fetch_backoff_s: float = setting("seconds before the first retry of a remote shard, doubled for each next "
                                           "one (at most 8 s); a dropped download resumes with a Range request", 0.5)
    shard_fetch_retry_window_s: float = setting("seconds without a byte from a remote shard after which it is not "
                                                "retried any more", 60.0)
    shard_fetch_min_bytes_per_s: int = setting("slowest download into the shard cache, bytes/s, after "
                                               "shard_fetch_retry_window_s: a slower one fails and frees its space "
                                               "(0: no minimum)", 256 << 10)
    max_shard_bytes: int = setting("largest remote shard read, bytes (its Content-Length or object size; counted "
                                   "when the server gives none)", 16 << 30)

    def check_reader(self) -> None:
        """ConfigError naming the first setting out of its range."""
        for name in ("max_shards", "max_member_bytes", "max_sample_bytes", "max_shard_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.shard_read_timeout_s <= 3600:
            raise ConfigError(f"shard_read_timeout_s must be in (0, 3600], got {self.shard_read_timeout_s}")
        if self.shard_cache_bytes < 0 or not 0 <= self.shard_fetch_retries <= 100:
            raise ConfigError(f"shard_cache_bytes must be >= 0 and shard_fetch_retries in [0, 100], got "
                              f"{self.shard_cache_bytes} and {self.shard_fetch_retries}")
        if self.shard_fetch_min_bytes_per_s < 0:
            raise ConfigError(f"shard_fetch_min_bytes_per_s must be >= 0, got {self.shard_fetch_min_bytes_per_s}")
        if not 0 <= self.shard_fetch_backoff_s <= 60 or not 0 < self.shard_fetch_retry_window_s <= 3600:
            raise ConfigError(f"shard_fetch_backoff_s must be in [0, 60] and shard_fetch_retry_window_s in (0, 3600], "
                              f"got {self.shard_fetch_backoff_s} and {self.shard_fetch_retry_window_s}")
        if self.max_sample_bytes < self.max_member_bytes:
            raise ConfigError(f"max_sample_bytes ({self.max_sample_bytes}) is below max_member_bytes "
                              f"({self.max_member_bytes})")


READER_DEFAULTS = ReaderConfig()
