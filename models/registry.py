"""The models a fleet can serve, and how each one's parts are loaded from a local directory.

A model = a family (data: token layout, codec shape, voices, sampling) + where its checkpoint lives.
``tiny`` (Orpheus' layout) and ``tiny-llasa`` (Llasa's single-codebook layout) are built from a fixed
seed into the data directory on first use; ``orpheus`` is a local copy
of an Orpheus checkpoint (NARRATE_ORPHEUS_DIR: the LM + tokenizer, the SNAC codec in ``snac/``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleet.settings import Settings
from models.espeak import espeak_family
from models.family import CodecLMFamily, SamplingDefaults
from models.llasa import llasa_family
from models.orpheus import orpheus_family
from models.piper import piper_family
from models.runaway import RunawayLimits
from models.single_stage import SingleStageFamily


class UnknownModelError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class ModelSpec:
    name: str
    #: Two-stage (codec LM + decoder) or single-stage (one engine yields audio; models/single_stage.py).
    family: CodecLMFamily | SingleStageFamily
    description: str
    #: The checkpoint directory for these settings (built if need be), or None if not configured.
    locate: Callable[[Settings], Path | None]
    #: Why the model cannot be served with these settings (None: it can). Cheap: never builds.
    problem: Callable[[Settings], str | None] = lambda _settings: None
    #: What its audio depends on besides the request (checkpoint files, engine version), for the
    #: segment cache (jobs/segcache.py): another checkpoint in the same place is another identity.
    #: Cheap: never builds. Default: the name alone (models whose weights come from a fixed seed).
    identity: Callable[[Settings], str] = lambda _settings: ""

    def checkpoint(self, settings: Settings) -> Path:
        path = self.locate(settings)
        if path is None:
            raise UnknownModelError(f"model {self.name!r} has no checkpoint configured")
        return path

    @property
    def single_stage(self) -> bool:
        return isinstance(self.family, SingleStageFamily)

    @property
    def worker_kinds(self) -> tuple[str, ...]:
        """The worker kinds that must be live for this model's jobs to progress (see fleet/readiness.py)."""
        return ("speech",) if self.single_stage else ("ar", "decoder")


#: What the codec-LM families import (the ``codec`` extra).
CODEC_MODULES = ("torch", "snac", "safetensors", "tokenizers", "transformers")


def codec_unavailable() -> str | None:
    """Why the codec-LM families cannot run here (None: they can). Cheap: imports nothing."""
    missing = [m for m in CODEC_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return (
            f"it needs the codec extra ({', '.join(missing)} missing): pip install 'narration-fleet[codec]' "
            "(CPU torch: add --extra-index-url https://download.pytorch.org/whl/cpu)"
        )
    return None


def _local_checkpoint_problem(setting: str, value: Path | None) -> str | None:
    if problem := codec_unavailable():
        return problem
    if value is None:
        return f"{setting} is not set"
    missing = [
        p
        for p in ("config.json", "snac/config.json", "snac/pytorch_model.bin")
        if not (Path(value) / p).exists()
    ]
    if missing:
        return f"{setting}={value} lacks {', '.join(missing)} (see docs/models.md)"
    return None


def _directory_identity(path: Path | None) -> str:
    """A checkpoint directory's files: names, sizes, modification times (hashed): cheap, and any
    new or rewritten file changes it."""
    if path is None or not Path(path).is_dir():
        return ""
    digest = hashlib.blake2b(digest_size=16)
    for file in sorted(Path(path).rglob("*")):
        if file.is_file():
            st = file.stat()
            digest.update(f"{file.relative_to(path)}\x1f{st.st_size}\x1f{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def model_identity(spec: ModelSpec, settings: Settings) -> str:
    return f"{spec.name}|{spec.identity(settings)}"


def _tiny_dir(settings: Settings) -> Path:
    from models.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(settings.data_dir)


def _tiny_llasa_dir(settings: Settings) -> Path:
    from models.tiny import ensure_tiny_llasa_checkpoint

    return ensure_tiny_llasa_checkpoint(settings.data_dir)


def _single_stage(family: SingleStageFamily, description: str) -> ModelSpec:
    """A single-stage model: its family says why it cannot run and what its audio depends on."""
    return ModelSpec(
        name=family.name,
        family=family,
        description=description,
        locate=lambda _settings: None,
        problem=family.unavailable_reason,
        identity=family.identity,
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="tiny",
            # random weights never choose to stop: a tight length budget keeps test audio short and
            # is how its segments end (so reaching it is no runaway); top-k sampling instead of
            # Orpheus' top-p spares CPU engines a full-vocabulary sort
            family=orpheus_family(
                name="tiny",
                max_frames_per_char=0.6,
                min_frames=8,
                sampling=SamplingDefaults(temperature=0.6, top_p=1.0, top_k=50, repetition_penalty=1.3),
                runaway=RunawayLimits(stop_required=False),
            ),
            description="Orpheus layout at test size, random weights from a fixed seed (noise, not speech)",
            locate=_tiny_dir,
            problem=lambda _settings: codec_unavailable(),
        ),
        ModelSpec(
            name="tiny-llasa",
            # Llasa's layout: one code per 20 ms frame, 16 kHz. Random weights never stop (the
            # budget ends a segment: 1.5 frames per character keeps test audio short); its codec (a
            # single-codebook SNAC) disturbs 10 frames on either side of a window edge (measured:
            # tests/models/test_llasa.py), hence 10 frames of context and of look-ahead
            family=llasa_family(
                name="tiny-llasa",
                max_frames_per_char=1.5,
                min_frames=20,
                sampling=SamplingDefaults(temperature=0.8, top_p=1.0, top_k=50, repetition_penalty=1.0),
                left_context_frames=10,
                lookahead_frames=10,
                runaway=RunawayLimits(stop_required=False),
            ),
            description="Llasa layout at test size (1 code per frame, 50 Hz, 16 kHz), random weights (noise)",
            locate=_tiny_llasa_dir,
            problem=lambda _settings: codec_unavailable(),
        ),
        ModelSpec(
            name="orpheus",
            family=orpheus_family(name="orpheus"),
            description="Orpheus 3B (Llama-3.2-3B + SNAC 24 kHz) from NARRATE_ORPHEUS_DIR",
            locate=lambda s: s.orpheus_dir,
            problem=lambda s: _local_checkpoint_problem("NARRATE_ORPHEUS_DIR", s.orpheus_dir),
            identity=lambda s: _directory_identity(s.orpheus_dir),
        ),
        _single_stage(
            espeak_family(),
            "eSpeak NG 1.52: formant speech in 100+ languages on one CPU core, single-stage "
            "(optional extra 'espeak', GPL-3.0-or-later)",
        ),
        _single_stage(
            piper_family(),
            "Piper: neural voices (VITS, ONNX) on the CPU, single-stage; voices from voice packages and "
            "NARRATE_PIPER_VOICES_DIR (optional extra 'piper': piper-tts GPL-3.0-or-later, the joe voice)",
        ),
    )
}


def served_models(settings: Settings) -> dict[str, ModelSpec]:
    """The models this fleet accepts jobs for (NARRATE_MODELS); a clear error if one cannot be served."""
    unknown = [m for m in settings.model_names if m not in MODELS]
    if unknown:
        raise UnknownModelError(
            f"unknown model(s) in NARRATE_MODELS: {', '.join(unknown)}; known: {', '.join(MODELS)}"
        )
    for name in settings.model_names:
        if problem := MODELS[name].problem(settings):
            raise UnknownModelError(f"model {name!r} is in NARRATE_MODELS but cannot be served: {problem}")
    return {name: MODELS[name] for name in settings.model_names}


def get_model(name: str, settings: Settings) -> ModelSpec:
    served = served_models(settings)
    if name not in served:
        raise UnknownModelError(f"unknown model {name!r}; this fleet serves: {', '.join(served)}")
    return served[name]


# --- loaders (heavy imports stay inside) -------------------------------------------------------------


class HFTextTokenizer:
    """The checkpoint's own tokenizer (tokenizer.json & co.), loaded with transformers."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(directory))

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text).input_ids)


def load_tokenizer(spec: ModelSpec, settings: Settings) -> HFTextTokenizer:
    return HFTextTokenizer(spec.checkpoint(settings))


def load_codec(spec: ModelSpec, settings: Settings):
    import torch

    from models.snac_codec import SnacCodec

    return SnacCodec.load(
        spec.checkpoint(settings) / "snac",
        spec.family.codec_levels,
        device=settings.device,
        compile=settings.decoder_compile,
        max_frames=settings.decode_max_frames,
        dtype=torch.bfloat16 if settings.decoder_bf16 else torch.float32,
        cut=settings.decoder_cut_windows,
        pass_cost_frames=settings.decode_pass_cost_frames,
    )


def load_engine(spec: ModelSpec, settings: Settings):
    """The AR engine named by settings.engine, over the model's LM checkpoint."""
    if settings.engine == "reference":
        from models.engines.reference import ReferenceEngine

        return ReferenceEngine(
            spec.checkpoint(settings),
            max_num_seqs=settings.engine_slots,
            max_model_len=settings.max_model_len,
            device=settings.device,
        )
    if settings.engine == "vllm":
        from models.engines.vllm_engine import VllmEngine

        if settings.vllm_quantization == "fp8" and settings.device != "cuda":
            # vLLM's CPU build has the option but not the kernels: it would fail deep in its start
            raise ValueError(
                "NARRATE_VLLM_QUANTIZATION=fp8 needs a CUDA GPU of compute capability 8.9 or more "
                "(NARRATE_DEVICE=cuda); vLLM's CPU build has no FP8 weight kernels"
            )
        if settings.vllm_kv_cache_dtype == "fp8" and settings.device == "cpu" and not cpu_has_fp8_kv_kernels():
            # vLLM's CPU attention refuses it in a worker process, after the engine has started loading
            raise ValueError(
                "NARRATE_VLLM_KV_CACHE_DTYPE=fp8 on the CPU needs an x86 CPU with AVX-512 or AMX "
                "(vLLM's CPU attention has FP8 cache kernels for those only); this CPU has neither"
            )
        return VllmEngine(
            spec.checkpoint(settings),
            codes_only_range=codes_only_range(spec, settings),
            max_num_seqs=settings.engine_slots,
            max_model_len=settings.max_model_len,
            dtype=settings.vllm_dtype,
            gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
            load_format=settings.vllm_load_format,
            enforce_eager=settings.vllm_enforce_eager,
            log_stats_s=settings.vllm_log_stats_s,
            extra_args=vllm_extra_args(settings),
        )
    raise ValueError(f"unknown engine {settings.engine!r} (use 'reference' or 'vllm')")


def cpu_has_fp8_kv_kernels() -> bool:
    """Whether vLLM's CPU build can keep an FP8 KV cache on this machine (its own test, read here)."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def codes_only_range(spec: ModelSpec, settings: Settings) -> tuple[int, int] | None:
    """[first, end) of the ids that get logits at all (the codes-only LM head), or None for the full
    head. ``vllm_codes_only_logits`` unset: on for the checkpoints the codes-only head stands in for
    (Llama), off for others; True: required (refused for others); False: the full head."""
    if settings.vllm_codes_only_logits is False:
        return None
    from models.engines.vllm_engine import CODES_ONLY_BASE

    config = json.loads((spec.checkpoint(settings) / "config.json").read_text())
    if config.get("architectures") == [CODES_ONLY_BASE]:
        return spec.family.layout.generated_range()
    if settings.vllm_codes_only_logits:
        raise ValueError(
            f"NARRATE_VLLM_CODES_ONLY_LOGITS needs a {CODES_ONLY_BASE} checkpoint; {spec.name!r} is "
            f"{config.get('architectures')}"
        )
    return None


def vllm_extra_args(settings: Settings) -> dict | None:
    """vLLM engine arguments that only go to vLLM when set (older versions never see them)."""
    extra = {}
    if settings.vllm_stream_interval != 1:  # vLLM >= 0.26; 1 is its default
        extra["stream_interval"] = settings.vllm_stream_interval
    if settings.vllm_kv_cache_memory_gb:
        extra["kv_cache_memory_bytes"] = int(settings.vllm_kv_cache_memory_gb * 2**30)
    if settings.vllm_quantization:
        extra["quantization"] = settings.vllm_quantization
    if settings.vllm_kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = settings.vllm_kv_cache_dtype
    return extra or None
