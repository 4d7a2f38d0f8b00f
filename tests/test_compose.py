"""docker-compose.yml stays consistent with the CLI: every service's command is a real command."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleet.settings import Settings
from narrate.cli import build_parser

COMPOSE = yaml.safe_load((Path(__file__).parents[1] / "docker-compose.yml").read_text())


def test_every_fleet_kind_is_a_service():
    assert {"valkey", "minio", "api", "ar-worker", "decoder", "assembler", "finalize-worker"} <= set(
        COMPOSE["services"]
    )


@pytest.mark.parametrize(
    "name", [n for n, s in COMPOSE["services"].items() if s.get("command", [None])[0] == "narrate"]
)
def test_service_command_parses(name):
    command = [
        part.replace("${NARRATE_DEFAULT_MODEL:-tiny}", "tiny")
        for part in COMPOSE["services"][name]["command"]
    ]
    try:
        args = build_parser().parse_args(command[1:])
    except SystemExit as exc:  # argparse's way of refusing
        pytest.fail(f"service {name}: `{' '.join(command)}` is not a narrate command ({exc})")
    assert callable(args.func)
    env = COMPOSE["services"][name]["environment"]
    assert env["REDIS_URL"].startswith("redis://valkey:")


def test_ar_worker_reserves_a_gpu():
    devices = COMPOSE["services"]["ar-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


#: The GPU services: each AR worker and decoder service, with the GPU it reserves.
GPU_SERVICES = {"ar-worker": "0", "decoder": "0", "ar-worker-gpu1": "1", "decoder-gpu1": "1"}


def gpu_of(name: str) -> str:
    """The one GPU a service reserves, by device_ids (compose refuses count beside device_ids)."""
    (device,) = COMPOSE["services"][name]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "count" not in device
    (gpu,) = device["device_ids"]
    return gpu


def test_every_gpu_service_reserves_its_own_gpu_by_device_ids():
    services = COMPOSE["services"]
    gpu_services = {n for n, s in services.items() if "devices" in str(s.get("deploy", {}))}
    assert gpu_services == set(GPU_SERVICES)
    assert {name: gpu_of(name) for name in GPU_SERVICES} == GPU_SERVICES
    for name in ("ar-worker-gpu1", "decoder-gpu1"):
        twin = services[name.removesuffix("-gpu1")]
        assert services[name]["command"] == twin["command"]
        # the same configuration as GPU 0's but its data directory (below), on a host with two GPUs
        assert {k: v for k, v in services[name]["environment"].items() if k != "NARRATE_DATA_DIR"} == {
            k: v for k, v in twin["environment"].items() if k != "NARRATE_DATA_DIR"
        }
        assert services[name]["profiles"] == ["two-gpus"] and "profiles" not in twin
    assert services["ar-worker-gpu1"]["deploy"]["replicas"] == services["ar-worker"]["deploy"]["replicas"]


def test_each_gpu_has_its_own_engine_start_lock():
    """A container sees its one GPU as GPU 0 (the lock's name, workers/runtime.py), so AR workers on
    different GPUs that share the data volume keep their locks in different data directories; those
    of one GPU share one (its engines start one at a time)."""
    data_dir = {name: COMPOSE["services"][name]["environment"]["NARRATE_DATA_DIR"] for name in GPU_SERVICES}
    by_gpu: dict[str, set[str]] = {}
    for name, gpu in GPU_SERVICES.items():
        by_gpu.setdefault(gpu, set()).add(data_dir[name])
    assert all(len(dirs) == 1 for dirs in by_gpu.values()), by_gpu
    assert len({next(iter(d)) for d in by_gpu.values()}) == len(by_gpu)  # one lock directory per GPU
    volumes = {name: COMPOSE["services"][name]["volumes"] for name in GPU_SERVICES}
    assert len({tuple(v) for v in volumes.values()}) == 1  # one volume: the directories are in it


def test_every_cli_command_has_a_service_or_is_local():
    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001 - argparse has no public API
    in_compose = {
        s["command"][1] for s in COMPOSE["services"].values() if s.get("command", [None])[0] == "narrate"
    }
    # the local, all-in-one, listing and data-directory commands
    assert commands - in_compose == {"file", "fleet", "models", "clean", "keys", "tenants"}


def test_every_narrate_variable_is_a_setting():
    """A misspelt NARRATE_* variable would be ignored silently (the settings ignore unknown names)."""
    fields = {f"NARRATE_{name.upper()}" for name in Settings.model_fields}
    used = {
        key
        for service in COMPOSE["services"].values()
        for key in service.get("environment", {})
        if key.startswith("NARRATE_")
    }
    assert {"NARRATE_DECODER_COMPILE", "NARRATE_UNIFORM_WINDOWS"} <= used
    assert used - fields == set()


def test_two_ar_engines_share_one_gpu():
    """The H200 configuration: two AR workers whose memory shares fit one GPU together, on each GPU."""
    per_gpu: dict[str, float] = {}
    for name in ("ar-worker", "ar-worker-gpu1"):
        ar = COMPOSE["services"][name]
        replicas = int(ar["deploy"]["replicas"].removeprefix("${NARRATE_AR_WORKERS:-").removesuffix("}"))
        share = float(ar["environment"]["NARRATE_VLLM_GPU_MEMORY_UTILIZATION"].split(":-")[1].rstrip("}"))
        assert replicas == 2
        per_gpu[gpu_of(name)] = per_gpu.get(gpu_of(name), 0.0) + replicas * share
    assert per_gpu.keys() == {"0", "1"} and all(total <= 0.8 for total in per_gpu.values()), per_gpu


# --- Prometheus (docs/metrics.md) -------------------------------------------------------------------

#: The commands whose processes serve their own /metrics on NARRATE_METRICS_PORT (workers/metrics.py).
WORKER_COMMANDS = {"ar-worker", "decoder-worker", "speech-worker", "assembler", "finalize-worker"}


def prometheus_config() -> dict:
    """The scrape config the compose file's prometheus service is given (mounted where it reads it)."""
    service = COMPOSE["services"]["prometheus"]
    (config_file,) = [a.split("=", 1)[1] for a in service["command"] if a.startswith("--config.file=")]
    (source,) = [v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == config_file]
    return yaml.safe_load((Path(__file__).parents[1] / source).read_text())


def scrape_jobs() -> dict[str, dict]:
    jobs = prometheus_config()["scrape_configs"]
    assert len({j["job_name"] for j in jobs}) == len(jobs)
    return {j["job_name"]: j for j in jobs}


def narrate_services(commands: set[str]) -> dict[str, dict]:
    return {
        name: s
        for name, s in COMPOSE["services"].items()
        if s.get("command", [None])[0] == "narrate" and s["command"][1] in commands
    }


def test_prometheus_is_a_service_with_its_config_in_the_repo():
    service = COMPOSE["services"]["prometheus"]
    assert service["image"].startswith("prom/prometheus:")
    assert "api" in service["depends_on"]
    assert prometheus_config()["global"]["scrape_interval"]


def test_the_api_is_scraped_on_its_port_and_path():
    (api,) = narrate_services({"api"}).values()
    port = api["command"][api["command"].index("--port") + 1]
    job = scrape_jobs()["api"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert [t for c in job["static_configs"] for t in c["targets"]] == [f"api:{port}"]


@pytest.mark.parametrize("name", sorted(narrate_services(WORKER_COMMANDS)))
def test_every_worker_service_serves_metrics_and_is_scraped_there(name):
    service = COMPOSE["services"][name]
    env = service["environment"]
    port = int(env["NARRATE_METRICS_PORT"])
    assert port > 0 and env["NARRATE_METRICS_HOST"] == "0.0.0.0"  # reachable from Prometheus' container
    # every replica of the service: its name resolves to each of them (A records), all on that port
    found = [
        (job, sd)
        for job in scrape_jobs().values()
        for sd in job.get("dns_sd_configs", [])
        if name in sd["names"]
    ]
    assert len(found) == 1, f"{name} is scraped by {len(found)} jobs"
    job, sd = found[0]
    assert sd["type"] == "A" and sd["port"] == port
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_every_scraped_name_is_a_service():
    targets = {
        t.split(":")[0]
        for j in scrape_jobs().values()
        for c in j.get("static_configs", [])
        for t in c["targets"]
    }
    names = {n for j in scrape_jobs().values() for sd in j.get("dns_sd_configs", []) for n in sd["names"]}
    assert targets | names <= set(COMPOSE["services"])
    assert names == set(narrate_services(WORKER_COMMANDS))
    everything = {n for n, s in COMPOSE["services"].items() if s.get("command", [None])[0] == "narrate"}
    assert everything == names | {"api"}  # every fleet process is scraped
