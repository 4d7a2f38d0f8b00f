"""What one step of the frame-constraint processor costs the engine core: host time and GPU time.

    python bench/constraint_step.py --device cuda --rows 512     # the H200 (needs vLLM for the class)
    python bench/constraint_step.py --device cpu --rows 16       # a functional check anywhere

vLLM's engine core calls ``FrameConstraintLogitsProcessor.apply`` once per step on the logits of
every running request, in its one Python thread, which is what limits a fast GPU
(docs/benchmarks.md). This drives the processor the way the engine core does (a full batch of
Orpheus-layout requests, output lists that grow by an async-scheduling placeholder each step,
logits of the 3B model's vocabulary) and measures, per step and by median over ``--steps`` steps:

- host: wall time of ``apply`` without any synchronisation (what the engine core's thread spends);
- gpu: CUDA-event time of the work it queued (what the GPU spends beside the forward pass);

for the processor as CUDA graphs and op by op (``NARRATE_VLLM_PROCESSOR_GRAPHS=0``), interleaved.
Prints RESULT lines and writes constraint-step.json to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 156_940
ORPHEUS = dict(base=128_266, stride=4096, size=4096, period=7, stop=[128_258])


def build(rows: int, device, graphs: bool):
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from models.engines.vllm_engine import (
        CONSTRAINT_KEY,
        PROCESSOR_GRAPHS_ENV,
        FrameConstraintLogitsProcessor,
    )

    os.environ[PROCESSOR_GRAPHS_ENV] = "1" if graphs else "0"
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=rows))
    proc = FrameConstraintLogitsProcessor(config, torch.device(device), device != "cpu")
    outputs = []
    added = []
    for i in range(rows):
        spec = dict(ORPHEUS, temperature=0.6, top_p=0.8, top_k=0, penalty=1.3, seed=1000 + i)
        params = SamplingParams(extra_args={CONSTRAINT_KEY: spec})
        outputs.append([])
        added.append((i, params, list(range(128_000, 128_041)), outputs[-1]))
    proc.update_state(BatchUpdate(rows, [], added, []))
    return proc, outputs


def time_processor(args, graphs: bool, pristine) -> dict:
    import torch

    proc, outputs = build(args.rows, args.device, graphs)
    logits = pristine.clone()
    cuda = args.device.startswith("cuda")
    host, events = [], []
    with torch.inference_mode():
        for step in range(args.warmup + args.steps):
            logits.copy_(pristine)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            proc.apply(logits)
            elapsed = time.perf_counter() - t
            if cuda:
                end.record()
            if step >= args.warmup:
                host.append(elapsed * 1e6)
                if cuda:
                    events.append((start, end))
            for out in outputs:
                out.append(-1)  # async scheduling: last step's token is not on the host yet
        if cuda:
            torch.cuda.synchronize()
    result = {"host_us": statistics.median(host), "host_us_p90": sorted(host)[int(0.9 * len(host))]}
    if events:
        result["gpu_us"] = statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="graphs / op by op, alternated this many times")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    import torch

    torch.manual_seed(0)
    pristine = torch.randn(args.rows, VOCAB, device=args.device)
    cuda = args.device.startswith("cuda")
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "rows": args.rows, "runs": []}
    for r in range(args.rounds):
        for graphs in [True, False] if cuda else [False]:
            row = {"round": r + 1, "graphs": graphs, **time_processor(args, graphs, pristine)}
            result["runs"].append(row)
            print(f"RESULT processor step: {json.dumps(row)}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "constraint-step.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
