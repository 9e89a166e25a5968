"""The deployment files, checked offline: docker-compose validates compose.yaml, the Kubernetes
manifests (rendered by kustomize) validate strictly against the 1.32 API schemas, and every
DISTTRAIN_* variable, port, module and flag they name exists in the code."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from preprocess_service.service import settings
from preprocess_service.service.cli import main as service_cli
from trainer.train import parse as trainer_parse

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE_BIN = REPO / ".venv-compose" / "bin" / "docker-compose"
KNOWN_ENV = set(settings.ENV_NAMES) | settings.CLIENT_ENV_NAMES
DEFAULTS = settings.ServiceSettings()
PORTS = {"grpc": DEFAULTS.port, "metrics": DEFAULTS.metrics_port, "redis": 6379, "rendezvous": 29500}


def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


OVERLAYS = ("base", "overlays/dev", "overlays/production")


def _k8s_documents(overlay: str = "base") -> list[dict]:
    """The manifests as kustomize renders them (kubectl's built-in kustomize)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) renders docker/k8s; install it to run this test"
    rendered = subprocess.run([kubectl, "kustomize", str(DOCKER / "k8s" / overlay)], capture_output=True, text=True,
                              check=True).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


def _pod_specs(documents: list[dict]) -> dict[str, dict]:
    specs = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in documents if "template" in d.get("spec", {})}
    specs |= {d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "Pod"}
    return specs


def test_compose_file_is_valid_for_docker_compose():
    assert COMPOSE_BIN.exists(), "./dev.sh setup installs docker-compose into .venv-compose"
    done = subprocess.run([str(COMPOSE_BIN), "-f", str(DOCKER / "compose.yaml"), "config", "-q"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    broken = DOCKER / "compose.broken.yaml"
    try:  # the validator does catch a mistake
        broken.write_text((DOCKER / "compose.yaml").read_text().replace("    image: redis:7.4-bookworm",
                                                                         "    image: redis:7.4-bookworm\n    imgae: x"))
        done = subprocess.run([str(COMPOSE_BIN), "-f", str(broken), "config", "-q"], capture_output=True, text=True)
        assert done.returncode != 0 and "imgae" in done.stderr
    finally:
        broken.unlink()


def test_compose_runs_redis_with_aof_two_replicas_and_a_trainer():
    services = _compose()["services"]
    redis_conf = (DOCKER / "redis.conf").read_text()
    assert "appendonly yes" in redis_conf and "appendfsync always" in redis_conf
    assert "./redis.conf:/usr/local/etc/redis/redis.conf:ro" in services["redis"]["volumes"]
    replicas = [name for name, s in services.items() if "serve" in (s.get("command") or ["serve"])
                and s.get("image", "").startswith("disttrain-service") and "entrypoint" not in s]
    assert replicas == ["replica-a", "replica-b"]
    for name in replicas:
        assert services[name]["environment"]["DISTTRAIN_REDIS_URL"] == "redis://redis:6379/0"
    trainer = services["trainer"]["command"]
    args = trainer_parse(trainer[trainer.index("trainer.train") + 1:])  # the flags exist and parse
    assert args.address == "replica-a:50051,replica-b:50051"
    assert args.enc_dp + args.bb_dp * args.bb_pp + args.gen_dp == int(trainer[trainer.index("--nproc-per-node") + 1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_manifests_validate_strictly(overlay):
    import kubernetes_validate

    documents = _k8s_documents(overlay)
    kinds = sorted(d["kind"] for d in documents)
    demo = ["Job"] if overlay == "overlays/dev" else []
    assert kinds == sorted(["ConfigMap", "ConfigMap", "Deployment", "Job", "PersistentVolumeClaim",
                            "PersistentVolumeClaim", "PodDisruptionBudget", "Service", "Service", "Service",
                            "StatefulSet", *demo])
    for doc in documents:
        kubernetes_validate.validate(doc, "1.32.0", strict=True)
    if overlay != "base":
        return
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["grpc"]["prot"] = 1  # the validator does catch a mistake
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.32.0", strict=True)


def test_kubernetes_service_probes_grpc_health_and_the_job_uses_torchrun(tmp_path):
    documents = _k8s_documents()
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == DEFAULTS.port
    assert next(d for d in documents if d["kind"] == "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    job = next(d for d in documents if d["kind"] == "Job")
    assert job["spec"]["completionMode"] == "Indexed"
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    config = next(d for d in documents
                  if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("disttrain-job"))
    args = trainer_parse(shlex.split(config["data"]["DISTTRAIN_TRAIN_ARGS"]) + ["--address", "x:1"])
    nodes, per_node = (int(trainer["args"][trainer["args"].index(f) + 1]) for f in ("--nnodes", "--nproc-per-node"))
    assert (args.enc_dp + args.bb_dp * args.bb_pp + args.gen_dp
            == nodes * per_node == job["spec"]["completions"] * per_node)
    assert "trainer.train" in trainer["args"]
    settings_map = next(d for d in documents
                        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("disttrain-settings"))
    path = tmp_path / "disttrain.toml"
    path.write_text(settings_map["data"]["disttrain.toml"])
    loaded = settings.load(path, environ={})  # the service reads it without an error
    assert (loaded.port, loaded.metrics_port) == (DEFAULTS.port, DEFAULTS.metrics_port)
    assert loaded.allowed_shard_prefixes == ("/data/shards",)


def _env_names() -> set[str]:
    names = set()
    for service in _compose()["services"].values():
        names |= set(service.get("environment") or {})
    for doc in _k8s_documents():
        if doc["kind"] == "ConfigMap":
            names |= {k for k in doc.get("data", {}) if k.startswith("DISTTRAIN_")}
        for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            names |= {e["name"] for e in container.get("env", [])}
    for dockerfile in DOCKER.glob("*.Dockerfile"):
        names |= set(re.findall(r"\bDISTTRAIN_[A-Z_]+", dockerfile.read_text()))
    return {n for n in names if n.startswith("DISTTRAIN_")}


def test_every_variable_and_port_named_in_the_deployment_exists_in_the_code():
    names = _env_names()
    assert {"DISTTRAIN_REDIS_URL", "DISTTRAIN_CONFIG", "DISTTRAIN_ADDRESS", "DISTTRAIN_TRAIN_ARGS"} <= names
    assert names <= KNOWN_ENV, f"unknown to the code: {sorted(names - KNOWN_ENV)}"
    source = "".join(p.read_text() for p in [*REPO.glob("preprocess_service/**/*.py"), *REPO.glob("trainer/**/*.py")])
    for name in names:
        assert name in source or name.removeprefix("DISTTRAIN_").lower() in settings.FIELDS, name
    # ports: compose's container ports, Kubernetes' containerPorts and the Dockerfiles' EXPOSE
    for service in _compose()["services"].values():
        for mapping in service.get("ports", []):
            assert int(str(mapping).split(":")[-1]) in PORTS.values(), mapping
        env = service.get("environment") or {}
        if "DISTTRAIN_PORT" in env:
            assert int(env["DISTTRAIN_PORT"]) == DEFAULTS.port
    for doc in _k8s_documents():
        for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for port in container.get("ports", []):
                assert PORTS[port["name"]] == port["containerPort"], port
        if doc["kind"] == "Service":
            for port in doc["spec"]["ports"]:
                assert PORTS[port["name"]] == port["port"], port
    for dockerfile in DOCKER.glob("*.Dockerfile"):
        for line in re.findall(r"^EXPOSE (.+)$", dockerfile.read_text(), re.M):
            assert {int(p) for p in line.split()} <= set(PORTS.values()), (dockerfile.name, line)


def test_images_install_the_right_torch_and_run_commands_that_exist():
    service = (DOCKER / "service.Dockerfile").read_text()
    trainer = (DOCKER / "trainer.Dockerfile").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu -r requirements/torch.txt" in service  # before `.`
    assert service.index("whl/cpu") < service.index('pip install -c requirements/lock.txt ".[service]"')
    assert "pip install -r requirements/torch.txt" in trainer and "whl/cpu" not in trainer \
        and "torch.version.cuda" in trainer
    assert (REPO / "requirements" / "torch.txt").read_text().split() == ["torch==2.13.0"]
    # the trainer image gets the client and the model pipeline without the service or its dependencies
    assert 'pip install -c requirements/lock.txt ".[trainer]"' in trainer and "COPY preprocess_service" not in trainer
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[=<>\[,]", d)[0].lower() for d in project["dependencies"]}
    assert base == {"torch", "numpy", "grpcio", "protobuf"}, base  # what trainer.client imports
    assert {"numba", "webdataset", "pillow", "redis"} <= {re.split(r"[=<>]", d)[0].lower()
                                                          for d in project["optional-dependencies"]["service"]}
    # the commands the images and compose run exist: `serve`, `health`, `synth` with its flags
    with pytest.raises(SystemExit) as done:
        service_cli(["health", "--help"])
    assert done.value.code == 0
    demo = _compose()["services"]["demo-data"]
    assert demo["entrypoint"][-1] == "synth"
    from disttrain_tools import synth

    flags = synth.build_parser().parse_args(demo["command"])
    assert flags.num_shards == 4 and flags.corrupt


def test_pods_are_sized_by_their_quota_and_ship_compiled_kernels():
    """The decode pool sizes itself from the CPU limit, so the service asks for as much as it may
    use; the planner's kernels are compiled into the image, outside the /tmp emptyDir."""
    deployment = next(d for d in _k8s_documents() if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    resources = container["resources"]
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    service = (DOCKER / "service.Dockerfile").read_text()
    cache = re.search(r"NUMBA_CACHE_DIR=(\S+)", service).group(1)
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert not any(cache == m or cache.startswith(m.rstrip("/") + "/") for m in mounts), (cache, mounts)
    assert "preprocess_service warm" in service and service.index("preprocess_service warm") < service.index("USER ")
    assert service_cli(["warm"]) == 0  # the command the image runs exists and compiles


def test_the_grafana_dashboard_plots_only_metrics_the_code_exports():
    """docker/grafana/disttrain-dashboard.json: valid JSON, every panel on the dashboard's data
    source, and every disttrain_* series it queries is one the service or the client registers."""
    from prometheus_client import REGISTRY

    from preprocess_service.adapters.infra import metrics  # noqa: F401
    from trainer.client import _DATA_WAIT

    _DATA_WAIT.counter()  # the client's data-wait counter, registered on first use

    dashboard = json.loads((DOCKER / "grafana" / "disttrain-dashboard.json").read_text())
    families = {family.name: family.type for family in REGISTRY.collect() if family.name.startswith("disttrain_")}
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
    exported = {name + suffix for name, kind in families.items() for suffix in suffixes.get(kind, ("",))}
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"\bdisttrain_[a-z_]+", target["expr"]))
    assert queried and queried <= exported, sorted(queried - exported)
    assert {"disttrain_client_data_wait_seconds_total", "disttrain_step_bubble_fraction"} <= queried


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_volume_and_image_a_pod_names_is_in_the_manifests(overlay):
    """No volume made by hand: each claim a pod mounts is a PersistentVolumeClaim of the same
    rendering (or a StatefulSet's template); each image is tagged (never :latest), the project's
    version in base and production, from a registry in production."""
    documents = _k8s_documents(overlay)
    claims = {d["metadata"]["name"] for d in documents if d["kind"] == "PersistentVolumeClaim"}
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for name, spec in _pod_specs(documents).items():
        templates = {t["metadata"]["name"] for d in documents if d["metadata"]["name"] == name
                     for t in d["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec["containers"] + spec.get("initContainers", []):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, (name, mount)
            image = container["image"]
            assert ":" in image and not image.endswith(":latest"), (name, image)
            if image.split(":")[0].endswith(("disttrain-service", "disttrain-trainer")):
                tag = image.rsplit(":", 1)[1]
                assert tag == {"overlays/dev": "dev"}.get(overlay, version), (overlay, image)
                assert (overlay == "overlays/production") == image.startswith("ghcr.io/"), image
                assert (overlay == "overlays/dev") == (container.get("imagePullPolicy") == "Never"), (name, image)
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, (name, volume)
    assert claims == {"disttrain-shards", "disttrain-checkpoints"}


def test_dev_overlay_writes_the_demo_data_the_trainer_waits_for_and_production_requires_tokens():
    from disttrain_tools import synth

    dev = _k8s_documents("overlays/dev")
    specs = _pod_specs(dev)
    writer = specs["disttrain-demo-data"]["containers"][0]
    script = writer["args"][0]
    synth_args = shlex.split(script.split("&&")[0])
    assert synth_args[:4] == ["python", "-m", "disttrain_tools", "synth"]
    flags = synth.build_parser().parse_args(synth_args[4:])
    marker = shlex.split(script.split("&&")[1])[-1]
    assert marker == f"{flags.out}/.complete"
    wait = specs["disttrain-trainer"]["initContainers"][0]["command"][-1]
    assert f"[ -f {marker} ]" in wait
    job_args = next(d for d in dev if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("disttrain-job"))
    assert f"--shards {flags.out} " in job_args["data"]["DISTTRAIN_TRAIN_ARGS"]
    assert {c["accessModes"][0] for c in (d["spec"] for d in dev if d["kind"] == "PersistentVolumeClaim")} \
        == {"ReadWriteOnce"}, "a one-node cluster's storage"

    production = _k8s_documents("overlays/production")
    service = _pod_specs(production)["disttrain-service"]
    auth = next(v for v in service["volumes"] if v["name"] == "auth")
    assert auth["secret"]["optional"] is False
    replicas = next(d for d in production if d["kind"] == "Deployment")["spec"]["replicas"]
    budget = next(d for d in production if d["kind"] == "PodDisruptionBudget")["spec"]["minAvailable"]
    assert replicas > budget >= 2
    args = next(d for d in production if d["kind"] == "ConfigMap"
                and d["metadata"]["name"].startswith("disttrain-job"))["data"]["DISTTRAIN_TRAIN_ARGS"]
    trainer_parse(shlex.split(args) + ["--address", "x:1"])  # the flags exist


def test_the_shards_loader_mounts_the_shards_claim_writable():
    import kubernetes_validate

    loader = yaml.safe_load((DOCKER / "k8s" / "shards-loader.yaml").read_text())
    kubernetes_validate.validate(loader, "1.32.0", strict=True)
    claim = next(v for v in loader["spec"]["volumes"] if v["name"] == "shards")["persistentVolumeClaim"]
    assert claim["claimName"] == "disttrain-shards" and not claim.get("readOnly")
    mount = loader["spec"]["containers"][0]["volumeMounts"][0]
    assert mount["mountPath"] == "/data/shards" and not mount.get("readOnly")
