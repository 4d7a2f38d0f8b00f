"""A user's Orpheus-style checkpoint directory loads through the same code a download would."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from fleet.messages import SegmentTask
from fleet.settings import Settings
from models.registry import (
    UnknownModelError,
    get_model,
    load_codec,
    load_engine,
    served_models,
)
from models.runaway import NEVER_STOPS, RunawayError
from models.tiny import build_lm, build_snac, build_tokenizer
from workers.ar import SegmentSynthesizer


@pytest.fixture(scope="module")
def user_checkpoint(tmp_path_factory):
    """Written with the real savers: transformers' save_pretrained (sharded safetensors), the
    tokenizer's save_pretrained, and the snac package's config + state dict."""
    from transformers import LlamaForCausalLM

    directory = tmp_path_factory.mktemp("my-orpheus")
    staging = tmp_path_factory.mktemp("staging")
    build_lm(staging, seed=7)
    LlamaForCausalLM.from_pretrained(str(staging)).save_pretrained(str(directory), max_shard_size="60MB")
    build_tokenizer(directory)
    build_snac(directory / "snac", seed=7)
    return directory


def test_orpheus_model_from_a_local_directory(user_checkpoint, tmp_path):
    index = json.loads((user_checkpoint / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, like the real 3B checkpoints
    settings = Settings(
        data_dir=tmp_path,
        models="orpheus",
        default_model="orpheus",
        orpheus_dir=user_checkpoint,
        max_model_len=1024,
    )
    spec = get_model("orpheus", settings)
    engine = load_engine(spec, settings)
    codec = load_codec(spec, settings)
    synth = SegmentSynthesizer.for_model(spec, settings, engine)
    task = SegmentTask("j", 0, "Hello from a local checkpoint.", "orpheus", "zoe", seed=3)

    async def run():
        windows = []
        try:
            async for batch in synth.windows(task, "j:0:1"):
                windows += batch
        except RunawayError as exc:  # random weights never stop: under Orpheus' limits, a runaway
            assert exc.kind == NEVER_STOPS
            return windows + exc.flush
        finally:
            await engine.shutdown()
        raise AssertionError("a model that never stops was not caught")

    windows = asyncio.run(run())
    audio = codec.decode_windows([(w.frames, w.left, w.right) for w in windows])
    total = sum(w.new_frames for w in windows)
    assert total > 0 and sum(a.shape[0] for a in audio) == total * 2048
    assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in audio)
    assert engine.runner.w["embed_tokens.weight"].dtype == torch.float64  # the CPU default


def test_a_model_that_cannot_be_served_is_a_clear_error(tmp_path):
    with pytest.raises(UnknownModelError, match="NARRATE_ORPHEUS_DIR is not set"):
        served_models(Settings(data_dir=tmp_path, models="tiny,orpheus"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(UnknownModelError, match="lacks snac/config.json, snac/pytorch_model.bin"):
        served_models(Settings(data_dir=tmp_path, models="orpheus", orpheus_dir=tmp_path / "half"))
    with pytest.raises(UnknownModelError, match="unknown model"):
        served_models(Settings(data_dir=tmp_path, models="nope"))


@pytest.mark.parametrize(
    ("architecture", "setting", "expected"),
    [
        ("LlamaForCausalLM", None, "codes"),  # unset: on for the architecture it stands in for
        ("LlamaForCausalLM", True, "codes"),
        ("LlamaForCausalLM", False, None),
        ("Qwen2ForCausalLM", None, None),  # unset: the full head for any other architecture
        ("Qwen2ForCausalLM", False, None),
        ("Qwen2ForCausalLM", True, "refused"),
    ],
)
def test_the_codes_only_head_is_the_default_for_llama_checkpoints(tmp_path, architecture, setting, expected):
    from models.orpheus import ORPHEUS_LAYOUT
    from models.registry import MODELS, codes_only_range

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    settings = Settings(
        data_dir=tmp_path, models="orpheus", orpheus_dir=tmp_path / "ckpt", vllm_codes_only_logits=setting
    )
    spec = MODELS["orpheus"]  # only config.json is read: no weights needed
    if expected == "refused":
        with pytest.raises(ValueError, match="needs a LlamaForCausalLM checkpoint"):
            codes_only_range(spec, settings)
    else:
        want = ORPHEUS_LAYOUT.generated_range() if expected == "codes" else None
        assert codes_only_range(spec, settings) == want
