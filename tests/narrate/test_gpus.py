"""`narrate fleet --gpus 0,1` (NARRATE_GPUS): where its AR workers and decoders go, what each child is
told (CUDA_VISIBLE_DEVICES), their names, the per-GPU memory check and the per-GPU engine-start lock;
without starting a fleet."""

from __future__ import annotations

import os
import sys

import pytest

from fleet.settings import Settings
from narrate.cli import build_parser, fleet_plan
from narrate.supervisor import Child, PlacementError, Supervisor, fleet_children
from workers.runtime import engine_start_lock_path

GPU_ENV = {"NARRATE_DEVICE": "cuda", "NARRATE_ENGINE": "vllm"}


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A clean NARRATE_* environment on a GPU host running vLLM (nothing here touches a GPU)."""
    for key in list(os.environ):
        if key.startswith("NARRATE_") or key == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(key)
    monkeypatch.setenv("NARRATE_DATA_DIR", str(tmp_path))
    for key, value in GPU_ENV.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def plan(*argv: str, **settings) -> list[Child]:
    args = build_parser().parse_args(["fleet", *argv])
    return fleet_plan(args, Settings(**settings))[1]


def layout(children: list[Child]) -> list[tuple[str, str | None]]:
    return [(c.name, c.env.get("CUDA_VISIBLE_DEVICES")) for c in children]


def test_without_gpus_nothing_is_pinned_and_the_names_are_todays(env):
    children = plan("--ar-workers", "2", vllm_gpu_memory_utilization=0.4)
    assert layout(children) == [
        ("api", None),
        ("ar-tiny-0", None),
        ("ar-tiny-1", None),
        ("decoder-0", None),
        ("assembler-0", None),
        ("finalizer-0", None),
    ]


def test_ar_workers_per_gpu_and_a_decoder_on_each(env):
    children = plan("--gpus", "0,1", "--ar-workers", "2", vllm_gpu_memory_utilization=0.37)
    assert layout(children) == [
        ("api", None),
        ("ar-tiny-g0-0", "0"),
        ("ar-tiny-g0-1", "0"),
        ("ar-tiny-g1-0", "1"),
        ("ar-tiny-g1-1", "1"),
        ("decoder-g0-0", "0"),
        ("decoder-g1-0", "1"),
        ("assembler-0", None),  # the CPU stages see what the fleet command sees
        ("finalizer-0", None),
    ]
    by_name = {c.name: c for c in children}
    assert by_name["ar-tiny-g1-0"].argv[-3:] == ["ar-worker", "--model", "tiny"]
    assert by_name["decoder-g1-0"].argv[-3:] == ["decoder-worker", "--models", "tiny"]


def test_the_setting_is_the_flags_default_and_the_flag_wins(env):
    env.setenv("NARRATE_GPUS", "2, 3")
    from_setting = [n for n, _ in layout(plan()) if n.startswith(("ar-", "decoder-"))]
    assert from_setting == ["ar-tiny-g2-0", "ar-tiny-g3-0", "decoder-g2-0", "decoder-g3-0"]
    from_flag = layout(plan("--gpus", "1", "--no-api"))
    assert from_flag[:2] == [("ar-tiny-g1-0", "1"), ("decoder-g1-0", "1")]
    # an empty --gpus: no pinning, whatever NARRATE_GPUS says
    assert layout(plan("--gpus", ""))[1:3] == [("ar-tiny-0", None), ("decoder-0", None)]


@pytest.mark.parametrize(
    ("where", "decoders"),
    [
        ("each", [("decoder-g0-0", "0"), ("decoder-g0-1", "0"), ("decoder-g1-0", "1"), ("decoder-g1-1", "1")]),
        ("first", [("decoder-g0-0", "0"), ("decoder-g0-1", "0")]),
        ("1", [("decoder-g1-0", "1"), ("decoder-g1-1", "1")]),
    ],
)
def test_decoders_are_placed_apart_from_the_ar_workers(env, where, decoders):
    env.setenv("NARRATE_DECODER_PLACEMENT", where)
    children = plan("--gpus", "0,1", "--decoders", "2")
    assert [x for x in layout(children) if x[0].startswith("decoder-")] == decoders
    assert [x for x in layout(children) if x[0].startswith("ar-")] == [("ar-tiny-g0-0", "0"), ("ar-tiny-g1-0", "1")]
    flag = plan("--gpus", "0,1", "--decoders", "2", "--decoder-placement", "first")
    assert [x[0] for x in layout(flag) if x[0].startswith("decoder-")] == ["decoder-g0-0", "decoder-g0-1"]


def test_every_model_gets_its_workers_on_every_gpu_and_metrics_ports_stay_in_order(env):
    children = plan("--gpus", "0,1", "--no-api", models="tiny,tiny-llasa", metrics_port=9500,
                    vllm_gpu_memory_utilization=0.3)  # fmt: skip
    assert [n for n, _ in layout(children)][:6] == [
        "ar-tiny-g0-0",
        "ar-tiny-llasa-g0-0",
        "ar-tiny-g1-0",
        "ar-tiny-llasa-g1-0",
        "decoder-g0-0",
        "decoder-g1-0",
    ]
    assert [int(c.env["NARRATE_METRICS_PORT"]) for c in children] == list(range(9500, 9500 + len(children)))
    assert children[0].env == {"CUDA_VISIBLE_DEVICES": "0", "NARRATE_METRICS_PORT": "9500"}


def test_the_ar_engines_of_one_gpu_must_fit_its_memory(env):
    assert plan("--gpus", "0,1", "--ar-workers", "2", vllm_gpu_memory_utilization=0.45)  # 0.90 each GPU
    with pytest.raises(PlacementError) as refused:
        plan("--gpus", "0,1", "--ar-workers", "3", vllm_gpu_memory_utilization=0.37)
    message = str(refused.value)
    assert "3 AR engines on each GPU" in message and "3 AR workers x 1 model" in message
    assert "NARRATE_VLLM_GPU_MEMORY_UTILIZATION=0.37 = 1.11" in message and "below 1" in message
    assert "--ar-workers" in message
    # two models: two engines per AR worker slot
    with pytest.raises(PlacementError, match=r"2 AR engines on each GPU .* = 1.20"):
        plan("--gpus", "0", models="tiny,tiny-llasa", vllm_gpu_memory_utilization=0.6)
    # unpinned they all take one GPU: the same check, as today's compose file keeps (tests/test_compose.py)
    with pytest.raises(PlacementError, match=r"2 AR engines on the one GPU they all take .* = 1.70"):
        plan("--ar-workers", "2")  # the default share, 0.85
    # no GPU memory share where no vLLM engine takes one
    assert plan("--ar-workers", "3", engine="reference")
    assert plan("--ar-workers", "3", device="cpu")


def test_what_cannot_be_placed_is_refused_before_anything_starts(env):
    with pytest.raises(PlacementError, match="listed twice"):
        plan("--gpus", "0,0", vllm_gpu_memory_utilization=0.4)
    with pytest.raises(PlacementError, match="'each', 'first' or one of the GPUs"):
        plan("--gpus", "0,1", "--decoder-placement", "2")
    with pytest.raises(PlacementError, match="set NARRATE_DEVICE=cuda"):
        plan("--gpus", "0,1", device="cuda:1")
    with pytest.raises(PlacementError, match="as CUDA_VISIBLE_DEVICES names them"):
        plan("--gpus", "0;1")
    with pytest.raises(ValueError, match="gpus"):  # the setting itself
        Settings(gpus="0 1;2")
    assert Settings(gpus=" 0 , GPU-8a1f-cc ").gpu_ids == ("0", "GPU-8a1f-cc")


def test_cli_says_what_is_wrong_and_exits_2(env, capsys):
    from narrate.cli import main

    assert main(["fleet", "--gpus", "0,1", "--ar-workers", "3"]) == 2  # 3 x 0.85 per GPU
    assert "3 AR engines on each GPU" in capsys.readouterr().err


def test_engine_start_lock_is_one_per_gpu(env, tmp_path):
    """Two AR workers on one GPU wait for each other's engine start; on different GPUs they do not."""
    children = plan("--gpus", "0,1", "--ar-workers", "2", vllm_gpu_memory_utilization=0.37)
    settings = Settings()

    def lock(child: Child):
        env.setenv("CUDA_VISIBLE_DEVICES", child.env["CUDA_VISIBLE_DEVICES"])
        return engine_start_lock_path(settings)

    locks = {c.name: lock(c) for c in children if c.name.startswith("ar-")}
    assert locks["ar-tiny-g0-0"] == locks["ar-tiny-g0-1"] == tmp_path / "locks" / "engine-start-gpu-0.lock"
    assert locks["ar-tiny-g1-0"] == locks["ar-tiny-g1-1"] == tmp_path / "locks" / "engine-start-gpu-1.lock"
    # unpinned (and without CUDA_VISIBLE_DEVICES) every engine takes GPU 0: one lock for all
    env.delenv("CUDA_VISIBLE_DEVICES")
    unpinned = plan("--ar-workers", "2", vllm_gpu_memory_utilization=0.4)
    assert all("CUDA_VISIBLE_DEVICES" not in c.env for c in unpinned)
    assert engine_start_lock_path(settings).name == "engine-start-gpu-0.lock"


def test_a_pinned_child_sees_only_its_gpu(env, tmp_path):
    """The supervisor hands each child its own CUDA_VISIBLE_DEVICES over the fleet command's own."""
    env.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # what the fleet command itself sees
    children = fleet_children(
        api=False, ar_workers=1, decoders=1, assemblers=1, finalizers=0, models=["tiny"], gpus=["0", "1"]
    )
    show = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"
    for child in children:
        child.argv = [sys.executable, "-c", show]
    sup = Supervisor(children, env=dict(os.environ), log_dir=tmp_path / "logs")
    sup.start()
    try:
        for child in children:
            child.process.wait(timeout=30)
    finally:
        sup.stop()
    seen = {c.name: (tmp_path / "logs" / f"{c.name}.log").read_text().strip() for c in children}
    assert seen == {"ar-tiny-g0-0": "0", "ar-tiny-g1-0": "1", "decoder-g0-0": "0", "decoder-g1-0": "1",
                    "assembler-0": "0,1"}  # fmt: skip


def test_engines_given_their_kv_cache_size_take_no_engine_start_lock(env):
    """vllm_kv_cache_memory_gb reaches vLLM as kv_cache_memory_bytes, and such an engine has no
    memory profile to protect: no engine-start lock (tests/integration/test_vllm_fleet.py starts two)."""
    from models.registry import vllm_extra_args
    from workers.ar import measures_memory_at_start

    profiled = Settings()
    given = Settings(vllm_kv_cache_memory_gb=43)
    assert measures_memory_at_start(profiled) and "kv_cache_memory_bytes" not in (vllm_extra_args(profiled) or {})
    assert not measures_memory_at_start(given)
    assert vllm_extra_args(given)["kv_cache_memory_bytes"] == 43 * 2**30
    assert measures_memory_at_start(Settings(engine="reference", vllm_kv_cache_memory_gb=43))
    with pytest.raises(ValueError):
        Settings(vllm_kv_cache_memory_gb=0)
