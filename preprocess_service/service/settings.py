"""The service's settings, with one name each in every place they can be given.

A setting ``redis_url`` is ``redis_url = "..."`` in the TOML file (``--config`` or
$DISTTRAIN_CONFIG), ``DISTTRAIN_REDIS_URL`` in the environment, and ``--redis-url`` on the command
line; later ones win (file < environment < flag). docker/compose.yaml and the Kubernetes
ConfigMap use these names, and a test checks that every DISTTRAIN_* variable they set is one of
them. Lists (auth_tokens, allowed_shard_prefixes) are comma-separated in the environment and on
the command line, arrays in the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from disttrain_api.errors import ConfigError
from preprocess_service.adapters.infra.config import BudgetConfig
from preprocess_service.adapters.io.config import ReaderConfig
from preprocess_service.adapters.io.config import setting as _doc

ENV_PREFIX = "DISTTRAIN_"


@dataclass(kw_only=True, frozen=True)
class ServiceSettings(ReaderConfig, BudgetConfig):
    """Every setting of the service: its own below, and those of the components it composes (the
    shard reader's: io/config.ReaderConfig; the memory budget's: infra/config.BudgetConfig), each
    one name in the file, the environment and on the command line."""

    host: str = _doc("address to listen on", "0.0.0.0")
    port: int = _doc("gRPC port (0: any free port)", 50051)
    metrics_port: int = _doc("Prometheus /metrics port (0: no metrics endpoint)", 9400)
    metrics_host: str = _doc("address /metrics listens on: loopback by default; 0.0.0.0 to let another pod "
                             "scrape it", "127.0.0.1")
    metrics_auth_tokens: tuple[str, ...] = _doc("bearer tokens a /metrics scrape must present; empty: none "
                                                "(its own tokens: a scraper gets no data-plane access)", ())
    metrics_auth_tokens_file: str | None = _doc("file with one /metrics token per line, added to metrics_auth_tokens")
    prefetch: int = _doc("microbatches prepared ahead per stream", 2)
    decode_workers: int | None = _doc("decode processes (unset: one per CPU of the quota; 0: threads in the server)")
    max_workers: int = _doc("gRPC handler threads: the most concurrent calls (each stream holds one)", 256)
    redis_url: str | None = _doc("Redis of a multi-replica deployment, e.g. redis://redis:6379/0 (unset: single node)")
    replica_id: str | None = _doc("this replica's name in leases (default host:port:pid)")
    state_dir: str | None = _doc("single node: directory where each job's state at its acknowledged step is kept, so "
                                 "a job opened again after a restart continues there (unset: it replans from step 0)")
    lease_ttl_s: float = _doc("seconds before a dead replica's planning lease passes to another", 5.0)
    stream_redis_timeout_s: float = _doc(
        "replicas: the longest a stream waits on Redis (a connect, a reply, retries) before it ends with "
        "UNAVAILABLE and its client moves to another replica (a replica cut from Redis while its clients still "
        "reach it); each try (a connect, a reply) gets half of it; the planner's tries are bounded the same, and it "
        "rides out longer faults", 2.0)
    log_format: str = _doc("text or json (one JSON object per line, with job, step and rank where known)", "text")
    log_level: str = _doc("DEBUG, INFO, WARNING or ERROR", "INFO")
    tls_cert: str | None = _doc("PEM certificate chain to serve TLS with (needs tls_key)")
    tls_key: str | None = _doc("PEM private key of tls_cert")
    tls_client_ca: str | None = _doc("PEM CA: clients must present a certificate it signed (mutual TLS)")
    auth_tokens: tuple[str, ...] = _doc("bearer tokens a call may present; empty: no token needed", ())
    auth_tokens_file: str | None = _doc("file with one bearer token per line (a mounted Secret), added to auth_tokens")
    max_request_bytes: int = _doc("largest request message in bytes", 4 << 20)
    warm_up: bool = _doc("load the planner's compiled kernels at start, in the background while the server already "
                         "serves (false: the first plan pays it)", True)
    plan_ahead: bool = _doc("plan a job's first step when it is opened, before any stream asks (its ranks' start-up "
                            "overlaps the shard reads; false: at the first stream)", True)
    max_streams_per_client: int = _doc("concurrent streams per client (its token, else its address); 0: no limit", 64)
    max_open_jobs: int = _doc("jobs open at once on this server; 0: no limit", 64)
    max_seq_len: int = _doc("longest packed sequence a job may ask for, tokens", 131_072)
    max_microbatch_bytes: int = _doc("largest microbatch a job's config may imply (every token at its costliest: "
                                     "a video token's two frames), bytes", 1 << 30)
    max_open_jobs_per_client: int = _doc("jobs one client (its token, else its address) may have opened at once; "
                                         "0: no limit", 16)
    stream_stall_timeout_s: float = _doc("seconds a stream's client may take no message before the stream is "
                                         "cancelled and its memory freed", 300.0)
    shm_delivery: bool = _doc("hand microbatches to clients on this host in shared memory (/dev/shm) when they "
                              "prove they share it (false: always in the gRPC message)", True)
    shutdown_grace_s: float = _doc("seconds SIGTERM lets open calls finish before the process exits anyway", 10.0)
    plugin_timeout_s: float = _doc("seconds one plugin hook may take on one sample before the sample fails",
                                   10.0)
    plugin_memory_mb: int = _doc("MiB one plugin hook call may grow its worker by before the sample fails and "
                                 "the worker is replaced", 1024)
    job_idle_ttl_s: float = _doc("seconds a job may go without a stream or call before it is closed and "
                                 "freed", 1800.0)
    def __post_init__(self) -> None:
        self.check_reader()
        self.check_budget()
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format must be text or json, got {self.log_format!r}")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name} must be a port number, got {getattr(self, name)}")
        for name in ("prefetch", "max_workers", "max_seq_len", "max_microbatch_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("stream_stall_timeout_s", "shutdown_grace_s", "stream_redis_timeout_s"):
            if not 0 < getattr(self, name) <= 86400:
                raise ConfigError(f"{name} must be in (0, 86400] seconds, got {getattr(self, name)}")
        if not 1 <= self.job_idle_ttl_s <= 30 * 86400:
            raise ConfigError(f"job_idle_ttl_s must be in [1, 2592000], got {self.job_idle_ttl_s}")

    def tokens(self) -> tuple[str, ...]:
        """auth_tokens plus those of auth_tokens_file."""
        return self.auth_tokens + _token_file(self.auth_tokens_file, "auth_tokens_file")

    def metrics_tokens(self) -> tuple[str, ...]:
        """metrics_auth_tokens plus those of metrics_auth_tokens_file."""
        return self.metrics_auth_tokens + _token_file(self.metrics_auth_tokens_file, "metrics_auth_tokens_file")


def _token_file(path: str | None, name: str) -> tuple[str, ...]:
    if not path:
        return ()
    try:
        tokens = tuple(t.strip() for t in Path(path).read_text().splitlines() if t.strip())
    except OSError as exc:
        raise ConfigError(f"{name} {path}: {exc.strerror}") from None
    if not tokens:
        raise ConfigError(f"{name} {path} holds no token")
    return tokens


FIELDS = {f.name: f for f in dataclasses.fields(ServiceSettings)}
ENV_NAMES = {ENV_PREFIX + name.upper(): name for name in FIELDS} | {ENV_PREFIX + "CONFIG": None}
"""Every environment variable the service reads (DISTTRAIN_CONFIG names the file)."""


def _convert(name: str, value):
    kind = FIELDS[name].type
    try:
        if "tuple" in kind:
            items = value.split(",") if isinstance(value, str) else value
            return tuple(str(v).strip() for v in items if str(v).strip())
        if value is None or value == "":
            return None if "None" in kind else FIELDS[name].default
        if kind.startswith("bool"):
            return _bool(value)
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"setting {name} = {value!r} is not a valid {kind}") from None


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _bool(value) -> bool:
    """A TOML bool, or a string as environment variables and flags give it (true/false, 1/0, yes/no, on/off)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ValueError(value)


def load(config_file: str | Path | None = None, environ=None, overrides: dict | None = None) -> ServiceSettings:
    """Defaults < TOML ``config_file`` (or $DISTTRAIN_CONFIG) < DISTTRAIN_* variables < ``overrides``."""
    environ = os.environ if environ is None else environ
    values: dict = {}
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG")
    if config_file:
        try:
            data = tomllib.loads(Path(config_file).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read the settings file {config_file}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"settings file {config_file} is not valid TOML: {exc}") from None
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise ConfigError(f"settings file {config_file} has unknown settings {unknown}; known: {sorted(FIELDS)}")
        values.update({k: _convert(k, v) for k, v in data.items()})
    for env, name in ENV_NAMES.items():
        if name and env in environ:
            values[name] = _convert(name, environ[env])
    unknown_env = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in ENV_NAMES
                         and k not in CLIENT_ENV_NAMES and k not in TOOL_ENV_NAMES)
    if unknown_env:
        logging.getLogger(__name__).warning("ignoring unknown settings in the environment: %s (a typo?)",
                                            ", ".join(unknown_env))
    values.update({k: _convert(k, v) for k, v in (overrides or {}).items() if v is not None})
    return ServiceSettings(**values)


CLIENT_ENV_NAMES = {"DISTTRAIN_AUTH_TOKEN", "DISTTRAIN_TLS_CA", "DISTTRAIN_ADDRESS", "DISTTRAIN_TRAIN_ARGS"}
"""Variables the client library and trainer read (disttrain_api.channel.Credentials, trainer.train);
DISTTRAIN_TLS_CERT / DISTTRAIN_TLS_KEY are shared with the server's names."""
TOOL_ENV_NAMES = {"DISTTRAIN_VENV", "DISTTRAIN_STREAM_PROFILE"}
"""Read by dev.sh and bench/stream.py, not by the service."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per setting, unset by default so the file and environment show through."""
    parser.add_argument("--config", metavar="FILE", help="TOML settings file ($DISTTRAIN_CONFIG)")
    for name, f in FIELDS.items():
        flags = ["--" + name.replace("_", "-")]
        flags += {"redis_url": ["--redis"], "lease_ttl_s": ["--lease-ttl"]}.get(name, [])
        parser.add_argument(*flags, dest=name, default=None, metavar=name.upper().removesuffix("_S"),
                            help=f"{f.metadata['help']} (${ENV_PREFIX}{name.upper()}; default {f.default!r})")


def from_args(args: argparse.Namespace) -> ServiceSettings:
    return load(args.config, overrides={name: getattr(args, name) for name in FIELDS})
