"""Static checks of cluster.yaml (the `ray up` config) and the Serve config files.

Neither ray nor torch is imported here (a rule for unit tests): the installed ray package is
located with importlib.util.find_spec, which does not execute it, and its autoscaler schema is
read as a plain JSON file.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from deployments.app_config import AppArgs

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[3]
CLUSTER_YAML = REPO / "cluster.yaml"
GPU_SERVE_CONFIG = REPO / "deployments" / "serve_config_gpu.yaml"
CPU_SERVE_CONFIG = REPO / "deployments" / "serve_config.yaml"
IMPORT_PATH = "deployments.app:build_app"
TORCH_PIN = "torch==2.13.0"
# The build_app arguments the GPU config sets; AppArgs accepts more.
GPU_CONFIG_ARGS = {"model", "served_model_name", "autoscaling", "ingress_replicas", "api_key", "engine_args",
                   "llm_server_actor_options", "ingress_actor_options", "admission", "ingress_admission"}


def _ray_package_dir() -> Path | None:
    spec = importlib.util.find_spec("ray")  # a top-level package: found, not executed
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def cluster() -> dict:
    with open(CLUSTER_YAML) as f:
        config = yaml.safe_load(f)
    assert isinstance(config, dict), "cluster.yaml must be a mapping"
    return config


@pytest.fixture(scope="module")
def gpu_serve_config() -> dict:
    with open(GPU_SERVE_CONFIG) as f:
        return yaml.safe_load(f)


def _gpu_worker_types(cluster: dict) -> dict[str, dict]:
    head = cluster["head_node_type"]
    gpu_families = re.compile(r"^(g\d|p\d)")  # AWS GPU instance families: g4dn, g5, g6, g6e, p4d, p5 ...
    return {name: node for name, node in cluster["available_node_types"].items()
            if name != head and (node.get("resources", {}).get("GPU", 0) > 0
                                 or gpu_families.match(node["node_config"].get("InstanceType", "")))}


def _index(commands: list[str], pattern: str) -> int:
    for i, command in enumerate(commands):
        if re.search(pattern, command):
            return i
    raise AssertionError(f"no command matches {pattern!r} in {commands!r}")


def test_find_spec_does_not_import_ray():
    loaded_before = "ray" in sys.modules
    _ray_package_dir()
    assert ("ray" in sys.modules) == loaded_before


def test_cluster_yaml_matches_rays_schema(cluster):
    ray_dir = _ray_package_dir()
    if ray_dir is None:
        pytest.skip("ray is not installed: its autoscaler schema (ray/autoscaler/ray-schema.json) is unavailable")
    schema_path = ray_dir / "autoscaler" / "ray-schema.json"
    assert schema_path.is_file(), f"{schema_path} missing from the installed ray"
    schema = json.loads(schema_path.read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    errors = sorted(validator_cls(schema).iter_errors(cluster), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors)


def test_schema_check_catches_a_bad_config(cluster):
    """The schema check above can fail: an unknown key and a fractional resource are rejected."""
    ray_dir = _ray_package_dir()
    if ray_dir is None:
        pytest.skip("ray is not installed: its autoscaler schema (ray/autoscaler/ray-schema.json) is unavailable")
    schema = json.loads((ray_dir / "autoscaler" / "ray-schema.json").read_text())
    bad = json.loads(json.dumps(cluster))
    bad["max_worker"] = 8
    for node in bad["available_node_types"].values():
        node["resources"] = {"GPU": 0.5}
    messages = [e.message for e in jsonschema.validators.validator_for(schema)(schema).iter_errors(bad)]
    assert any("max_worker" in m for m in messages), messages
    assert any("0.5" in m for m in messages), messages


def test_cluster_name_and_head_node(cluster):
    assert cluster["cluster_name"] == "iterserve"
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert head.get("resources", {}).get("GPU", 0) == 0, "the head node must not advertise GPUs"
    assert cluster["provider"]["type"] == "aws"


def test_gpu_worker_group(cluster):
    workers = _gpu_worker_types(cluster)
    assert workers, "no worker node type with GPU resources or a GPU instance type"
    for name, node in workers.items():
        assert "InstanceType" in node["node_config"], name
        assert 0 <= node.get("min_workers", 0) <= node["max_workers"], name
        assert node["max_workers"] <= cluster["max_workers"], f"{name}: max_workers above the cluster limit"
    assert sum(node.get("min_workers", 0) for node in workers.values()) >= 1, "no GPU node is kept warm"


def test_file_mounts_and_rsync_exclude(cluster):
    assert cluster["file_mounts"].get("~/iterserve") == "."
    assert {".venv", ".git", "__pycache__"} <= set(cluster["rsync_exclude"])


def test_setup_installs_torch_before_ray_and_iterserve(cluster):
    commands = cluster["setup_commands"]
    torch_at = _index(commands, r"pip install .*" + re.escape(TORCH_PIN))
    iterserve_at = _index(commands, r"pip install -e \S*iterserve")
    assert torch_at < iterserve_at, "torch must be installed (pinned) before iterserve"
    ray_at = _index(commands, r"pip install .*\bray\[")
    assert torch_at < ray_at
    # flash-attn (the [gpu] extra) is optional: its failure must not fail the setup.
    gpu_extra = commands[_index(commands, r"iterserve\[gpu\]")]
    assert "||" in gpu_extra


def test_cluster_ray_matches_local_ray(cluster):
    """`ray up` needs the same Ray version on the cluster as on the machine running it."""
    try:
        local = importlib.metadata.version("ray")  # reads metadata only, does not import ray
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ray is not installed")
    commands = cluster["setup_commands"]
    pin = re.search(r"ray\[[\w,]+\]==([\w.]+)", commands[_index(commands, r"pip install .*\bray\[")])
    assert pin, "the Ray install on the cluster must be pinned"
    assert pin.group(1) == local


def test_deploy_command_runs_last_with_a_config_in_the_repo(cluster):
    commands = cluster["head_start_ray_commands"]
    deploy_at = _index(commands, r"serve deploy")
    start_at = _index(commands, r"ray start --head")
    assert start_at < deploy_at == len(commands) - 1, "serve deploy must be the final head start command"
    deploy = commands[deploy_at]
    assert re.search(r"cd ~/iterserve\b", deploy), "serve deploy must run from the synced checkout"
    paths = set(re.findall(r"serve deploy\s+(\S+\.ya?ml)", deploy))
    assert paths, f"no config file in {deploy!r}"
    for path in paths:
        assert (REPO / path).is_file(), f"{path} (deployed from ~/iterserve) is not in the repository"


@pytest.mark.parametrize("path", [GPU_SERVE_CONFIG, CPU_SERVE_CONFIG], ids=lambda p: p.name)
def test_serve_config_imports_build_app(path):
    with open(path) as f:
        config = yaml.safe_load(f)
    applications = config["applications"]
    assert isinstance(applications, list) and applications
    for app in applications:
        assert app["import_path"] == IMPORT_PATH
        AppArgs.parse(app.get("args"))  # raises on an unknown key or a bad value


def test_gpu_serve_config_values(gpu_serve_config):
    assert gpu_serve_config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    (app,) = gpu_serve_config["applications"]
    assert app["route_prefix"] == "/"
    args = app["args"]
    assert GPU_CONFIG_ARGS <= set(args), GPU_CONFIG_ARGS - set(args)
    assert args["engine_args"]["device"] == "cuda"
    assert args["llm_server_actor_options"]["num_gpus"] == 1


def test_llm_replica_fits_a_gpu_worker(cluster, gpu_serve_config):
    """A replica that asks for more than any worker node type offers stays PENDING forever."""
    options = gpu_serve_config["applications"][0]["args"]["llm_server_actor_options"]
    wanted = {"GPU": options.get("num_gpus", 0), "CPU": options.get("num_cpus", 1)}
    declared = {name: node["resources"] for name, node in _gpu_worker_types(cluster).items()
                if {"CPU", "GPU"} <= set(node.get("resources", {}))}
    if not declared:
        pytest.skip("GPU worker resources are left to Ray to detect")
    fits = [name for name, resources in declared.items()
            if all(resources[k] >= v for k, v in wanted.items())]
    assert fits, f"no GPU worker type offers {wanted}: {declared}"
