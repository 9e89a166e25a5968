"""The layers a newcomer reads in the tree hold in the imports: the trainer's client loads the
light API package and none of the service (numba, webdataset, Pillow, Redis, the server); the
API checks a planner name's form, the service's registry which exist; no module takes another's
private names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO


def _loaded_by(imports: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``imports``."""
    code = f"import json, sys\n{imports}\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True)
    return set(json.loads(out.stdout))


def test_importing_the_client_loads_no_service_module_or_heavy_dependency():
    modules = _loaded_by("import trainer.client")
    heavy = {"numba", "webdataset", "PIL", "redis", "torchaudio", "simplejpeg", "soundfile", "prometheus_client"}
    assert not heavy & modules, f"import trainer.client loads {sorted(heavy & modules)}"
    service = sorted(m for m in modules if m == "preprocess_service" or m.startswith("preprocess_service."))
    assert not service, f"import trainer.client loads service modules {service}"
    assert "disttrain_api.channel" in modules and "disttrain_api.config" in modules  # it does load the API


def test_the_server_process_loads_no_torch_until_it_decodes():
    """The service plans from headers: torch (~1 CPU-second, ~200 MiB per process) is for the
    decoders alone, so the server, the run CLI and the planner's process do not import it."""
    modules = _loaded_by("import preprocess_service.service.server, preprocess_service.service.cli\n"
                         "import disttrain_tools.runner, preprocess_service.adapters.media.parse")
    assert not {"torch", "torchaudio", "webdataset"} & modules, sorted({"torch", "torchaudio", "webdataset"} & modules)
    assert {"preprocess_service.adapters.media.imaging", "preprocess_service.adapters.media.audio"} <= modules


def test_a_planner_is_named_by_the_service_registry_alone():
    """The API checks only a planner name's form, so a planner added as a file on the service side
    (core/reorder/) needs no API change; the service refuses names it has not registered."""
    from disttrain_api.config import JobConfig
    from disttrain_api.errors import ConfigError
    from preprocess_service.core.reorder import PLANNERS

    for name in PLANNERS:
        assert JobConfig(shards=("s",), reorder_algorithm=name).reorder_algorithm == name
    assert JobConfig(shards=("s",), reorder_algorithm="my-planner").reorder_algorithm == "my-planner"
    for bad in ("", "Ours", "ours deep", "x" * 33, "../ours"):
        with pytest.raises(ConfigError, match="not a planner's name"):
            JobConfig(shards=("s",), reorder_algorithm=bad)


def test_the_layer_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "broken" not in out.stdout.lower().replace("0 broken", "")


def test_no_package_module_takes_another_modules_private_names():
    """A leading underscore means "this module's own": the runtime and the tools never import one."""
    import ast

    ours = ("disttrain_api", "preprocess_service", "trainer", "disttrain_tools")
    taken = []
    for package in ours:
        for path in sorted((REPO / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ours:
                    taken += [f"{path.relative_to(REPO)}: {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_")]
    assert not taken, taken


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Every import a package module makes, at the top or inside a function (an import moved into
    a function hides a cycle, it does not remove it), except under ``if TYPE_CHECKING:``. An
    import of a module's own parent package is not an edge: Python has imported it first anyway,
    and a package's ``__init__`` that imports its files (a registry) is how the tree is meant."""
    import ast

    ours = ("disttrain_api", "preprocess_service", "trainer", "disttrain_tools")
    paths = {_module_name(p): p for package in ours for p in (REPO / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        edges = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                           for a in node.names]
            for target in targets:
                if target in paths and target != name and not name.startswith(target + "."):
                    edges.add(target)
        graph[name] = edges
    return graph


def test_no_import_cycles_between_package_modules():
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"modules that import each other (directly or around a circle): {cycles}"


def test_the_cycle_check_sees_an_import_hidden_in_a_function():
    graph = _import_graph()
    assert "preprocess_service.service.shared_job" in graph["preprocess_service.service.server"]  # in a function
    assert "disttrain_api.layout" in graph["disttrain_api.config"]
