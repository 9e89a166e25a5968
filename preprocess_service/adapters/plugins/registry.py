"""The plugins this service has installed: the ``disttrain.plugins`` entry points of the Python
packages in its environment (disttrain_api/plugins.py says what a plugin is).

Installing a package is how an operator enables a plugin; a job only names one (JobConfig.plugins)
and a name that is not installed is refused. Entry points are loaded when a job first names them,
never from anything a request sends.
"""

from __future__ import annotations

import functools
import importlib.metadata
import threading

from disttrain_api.config import PluginConfig
from disttrain_api.errors import ConfigError
from disttrain_api.plugins import ENTRY_POINT_GROUP, Plugin

_lock = threading.Lock()


def installed() -> dict[str, importlib.metadata.EntryPoint]:
    """Name -> entry point of every plugin installed now (the environment is scanned each call:
    a package installed while the service runs is seen by the next job)."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, entry)  # the first on sys.path wins, as for imports
    return found


def describe() -> list[dict]:
    """Each installed plugin: its name, the distribution and version that registers it, its target."""
    out = []
    for name, entry in sorted(installed().items()):
        dist = entry.dist
        out.append({"name": name, "value": entry.value,
                    "distribution": dist.metadata["Name"] if dist is not None else "",
                    "version": dist.version if dist is not None else ""})
    return out


def plugin_class(name: str) -> type[Plugin]:
    """The class registered as ``name``; ConfigError if none is, or it is not a Plugin."""
    entry = installed().get(name)
    if entry is None:
        raise ConfigError(f"plugin {name!r} is not installed on this service; installed: "
                          f"{sorted(installed()) or 'none'} (an operator installs plugins as Python packages "
                          f"registering entry points in the {ENTRY_POINT_GROUP!r} group)")
    with _lock:
        try:
            cls = entry.load()
        except Exception as exc:  # the operator's package is broken: the job cannot run
            raise ConfigError(f"plugin {name!r} ({entry.value}) cannot be loaded: {type(exc).__name__}: {exc}") \
                from None
    if not (isinstance(cls, type) and issubclass(cls, Plugin)):
        raise ConfigError(f"plugin {name!r} ({entry.value}) is not a disttrain_api.plugins.Plugin subclass")
    return cls


def instantiate(config: PluginConfig) -> Plugin:
    """The plugin ``config`` names, made with its parameters; ConfigError naming the plugin when the
    name is not installed or it refuses the parameters."""
    return _instance(config.name, config.params_json)


@functools.lru_cache(maxsize=64)
def _instance(name: str, params: str) -> Plugin:
    cls = plugin_class(name)
    try:
        return cls(PluginConfig(name=name, params=params).parsed_params())
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"plugin {name!r} refuses its params {params:.200}: {exc}") from None


def check(configs: tuple[PluginConfig, ...]) -> str:
    """Refuses (ConfigError) a job whose plugins are not installed or refuse their parameters;
    returns a fingerprint of what will run (each plugin's name, distribution and version), so a
    job's saved state is not resumed by another version of a plugin."""
    parts = []
    for config in configs:
        instantiate(config)
        entry = installed()[config.name]
        dist = entry.dist
        parts.append(f"{config.name}={entry.value}@{dist.version if dist is not None else '?'}")
    return ";".join(parts)
