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
    assert "NARRATE_DECODER_COMPILE" in used
    assert used - fields == set()


def test_two_ar_engines_share_one_gpu():
    """The H200 configuration: two AR workers whose memory shares fit one GPU together."""
    ar = COMPOSE["services"]["ar-worker"]
    replicas = int(ar["deploy"]["replicas"].removeprefix("${NARRATE_AR_WORKERS:-").removesuffix("}"))
    share = float(ar["environment"]["NARRATE_VLLM_GPU_MEMORY_UTILIZATION"].split(":-")[1].rstrip("}"))
    assert replicas == 2 and replicas * share <= 0.8
