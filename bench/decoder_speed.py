"""The SNAC 24 kHz decoder's speed, variants side by side in one process on one device.

    python bench/decoder_speed.py --device cuda --out results/     # H200
    python bench/decoder_speed.py --device cpu --batches 1 --repeats 3

Windows as the fleet sends them in steady state: 25 new frames with 4 frames of left context and 3
of look-ahead (32 frames, 2.13 s of new audio), random codes, random weights (the full 24 kHz
shape). For each variant and batch size: audio-seconds of new audio decoded per second (the median
of --repeats timed calls after warm-up; the device is synchronised around each call).

Variants:
- ``snac``: the snac package as published (weight norm recomputed on every call);
- ``fleet``: models.snac_codec.SnacCodec as the decoder worker runs it (weight norm folded in once);
- ``fleet_compiled``: the same under torch.compile (--compile);
- ``fleet_bf16``: the same with its weights and activations in bfloat16 (--bf16, as ``decoder_bf16``
  runs it; not bit-identical to fp32; with --compile also ``fleet_compiled_bf16``).

``--memory`` measures memory instead of speed (the fleet's decoder, eager): the peak of live tensors
per frame decoded, for each batch size; on a GPU also what PyTorch's allocator holds over a stream
of batches shaped like the fleet's (1 to ``decode_batch`` windows, most of 4 + 25 + 3 frames, final
windows shorter), held to ``--memory-limit-gb`` as a decoder worker with ``decoder_gpu_memory_gb``
holds itself (set at the start: the allocator reads its reclaim threshold once):

    python bench/decoder_speed.py --device cuda --memory                       # as the fleet runs now
    python bench/decoder_speed.py --device cuda --memory --memory-limit-gb 8   # with the limit

``--windows`` decodes the windows of the fleet bench's 4 x 400 workload (bench/fleet_vs_vllm.py's
books, every segment at its whole budget, random codes) as FrameChunker cuts them with and without
``uniform`` (``uniform_windows``), in reads of ``--read-sizes`` chunks as a decoder takes them off
the stream, and gives new audio-s/s for each, interleaved ``--repeats`` times (a subset of
``--window-count`` windows from all over the books), each decoded whole and cut to the frames a
window keeps past the decoder's first block (``decoder_cut_windows``, the default; the later blocks'
passes grouped as the fleet's decoder groups them, by ``decode_pass_cost_frames``, and ``cut@N`` as
a pass cost of N frames would group them, ``--pass-costs``; 0: the fewest frames), with the passes
through the first block and through the rest per read, and the frames through the rest per new frame
(on the CPU also as a GPU decoder would batch them; ``--plan-only``: those alone, nothing decoded;
``--device-time``: each decoded once more under torch.profiler, the kernels' time summed, which is
what the decoder takes from AR engines beside it on one GPU, where the wall time also counts
launching the kernels):

    python bench/decoder_speed.py --device cuda --compile --bf16 --windows
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LEVELS = [[0], [1, 4], [2, 3, 5, 6]]  # Orpheus' 7 codes per frame -> SNAC's 3 levels
LEFT, NEW, RIGHT = 4, 25, 3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="let cuDNN time its algorithms for each new shape and keep the fastest (every variant)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--memory", action="store_true", help="peak memory instead of speed (above)")
    parser.add_argument("--memory-limit-gb", type=float, default=None)
    parser.add_argument("--mix-batches", type=int, default=400, help="with --memory on a GPU")
    parser.add_argument(
        "--decode-batch", type=int, default=64, help="with --memory: windows per batch at most"
    )
    parser.add_argument("--max-frames", type=int, default=None, help="with --memory: decode_max_frames")
    parser.add_argument("--windows", action="store_true", help="the fleet's windows, uniform or not (above)")
    parser.add_argument("--read-sizes", default="8,32", help="with --windows: chunks per decoder read")
    parser.add_argument("--window-count", type=int, default=2000, help="with --windows")
    parser.add_argument(
        "--plan-only", action="store_true", help="with --windows: the passes only, no decoding"
    )
    parser.add_argument(
        "--device-time",
        action="store_true",
        help="with --windows: also the kernels' time for the windows, once under torch.profiler",
    )
    parser.add_argument(
        "--chunk-frames",
        default="",
        help="with --windows: also uniform windows of chunks of these many new frames (the default: 25)",
    )
    parser.add_argument(
        "--pass-costs",
        default="0",
        help="with --windows: also cut windows grouped with these pass costs (frames)",
    )
    args = parser.parse_args()
    if args.cudnn_benchmark:
        import torch

        torch.backends.cudnn.benchmark = True
    if args.memory:
        return memory(args)
    if args.windows:
        return window_mix(args)

    import numpy as np
    import torch
    from snac import SNAC
    from snac.layers import NoiseBlock

    from models.snac_codec import SNAC_24KHZ_CONFIG, SnacCodec

    def model() -> SNAC:
        torch.manual_seed(0)
        return SNAC(**SNAC_24KHZ_CONFIG).eval()

    published = model().to(args.device)
    for module in list(published.modules()):  # the fleet's one change that is not about speed
        for name, child in list(module.named_children()):
            if isinstance(child, NoiseBlock):
                setattr(module, name, torch.nn.Identity())

    def snac_decode(frames: np.ndarray) -> np.ndarray:
        t = torch.as_tensor(frames, dtype=torch.long, device=args.device)
        with torch.inference_mode():
            audio = published.decode([t[:, :, level].reshape(t.shape[0], -1) for level in LEVELS])
        return audio[:, 0].float().cpu().numpy()

    codec = SnacCodec(model(), LEVELS, device=args.device)
    variants = {"snac": snac_decode, "fleet": codec.decode_frames}
    if args.bf16:  # as NARRATE_DECODER_BF16=1 runs it: weights and activations in bfloat16
        variants["fleet_bf16"] = SnacCodec(
            model(), LEVELS, device=args.device, dtype=torch.bfloat16
        ).decode_frames
    if args.compile:  # as NARRATE_DECODER_COMPILE=1 runs it (dynamic shapes)
        variants["fleet_compiled"] = SnacCodec(
            model(), LEVELS, device=args.device, compile=True
        ).decode_frames
    if args.compile and args.bf16:  # both settings on
        variants["fleet_compiled_bf16"] = SnacCodec(
            model(), LEVELS, device=args.device, compile=True, dtype=torch.bfloat16
        ).decode_frames

    rng = np.random.default_rng(0)
    seconds_per_window = NEW * codec.samples_per_frame / codec.sample_rate
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    results: dict[str, dict[int, float]] = {}
    check = rng.integers(0, 4096, size=(2, LEFT + NEW + RIGHT, 7)).astype(np.int32)
    expected = snac_decode(check)
    max_diff = {}
    for name, decode in variants.items():
        results[name] = {}
        for batch in [int(b) for b in args.batches.split(",")]:
            frames = rng.integers(0, 4096, size=(batch, LEFT + NEW + RIGHT, 7)).astype(np.int32)
            started = time.perf_counter()
            for _ in range(3):
                decode(frames)  # warm-up (and compilation)
            warm_s = time.perf_counter() - started
            times = []
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                decode(frames)
                sync()
                times.append(time.perf_counter() - t0)
            rate = batch * seconds_per_window / statistics.median(times)
            results[name][batch] = rate
            print(
                f"RESULT decoder {name} batch {batch}: {rate:.0f} audio-s/s (warm-up {warm_s:.1f} s)",
                flush=True,
            )
        for length in (17, 9):  # final windows come in other lengths: what does a new shape cost?
            odd = rng.integers(0, 4096, size=(5, length, 7)).astype(np.int32)
            sync()
            t0 = time.perf_counter()
            decode(odd)
            sync()
            print(
                f"RESULT decoder {name}: first call on a new shape (5 x {length} frames) {time.perf_counter() - t0:.2f} s",
                flush=True,
            )
        max_diff[name] = float(np.abs(decode(check) - expected).max())
        print(f"RESULT decoder {name}: max |difference| from snac {max_diff[name]:.2e}", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decoder_speed.json").write_text(
            json.dumps({"device": args.device, "audio_s_per_s": results, "max_diff": max_diff}, indent=2)
        )
    return 0


def memory(args) -> int:
    import weakref

    import numpy as np
    import torch
    from snac import SNAC
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.snac_codec import SNAC_24KHZ_CONFIG, SnacCodec
    from workers.runtime import limit_gpu_memory

    limited = limit_gpu_memory(args.memory_limit_gb, args.device)  # before the first allocation
    print(f"RESULT decoder memory limit: {limited or 'none'}", flush=True)
    torch.manual_seed(0)
    codec = SnacCodec(
        SNAC(**SNAC_24KHZ_CONFIG).eval(), LEVELS, device=args.device, max_frames=args.max_frames
    )

    class LiveTensors(TorchDispatchMode):
        """The bytes of tensors alive at once: every op's new storages, until they are freed."""

        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.seen: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                    continue
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
            return out

        def _freed(self, key: int, nbytes: int) -> None:
            self.live -= nbytes
            self.seen.discard(key)

    rng = np.random.default_rng(0)
    window = LEFT + NEW + RIGHT
    per_frame = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        frames = rng.integers(0, 4096, size=(batch, window, 7)).astype(np.int32)
        counter = LiveTensors()
        with counter:
            codec.decode_frames(frames)
        per_frame[batch] = counter.peak / (batch * window)
        print(
            f"RESULT decoder memory batch {batch} x {window} frames: peak of live tensors "
            f"{counter.peak / 2**20:.0f} MiB ({per_frame[batch] / 2**20:.2f} MiB per frame)",
            flush=True,
        )
    mix = None
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        audio_s = 0.0
        for _ in range(args.mix_batches):
            windows = []
            for _ in range(int(rng.integers(1, args.decode_batch + 1))):
                new = NEW if rng.random() < 0.7 else int(rng.integers(1, NEW + 1))  # final windows: shorter
                right = RIGHT if new == NEW else 0
                windows.append(
                    (rng.integers(0, 4096, size=(LEFT + new + right, 7)).astype(np.int32), LEFT, right)
                )
                audio_s += new * codec.samples_per_frame / codec.sample_rate
            codec.decode_windows(windows)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        mix = {
            "batches": args.mix_batches,
            "reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
            "allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "audio_s_per_s": audio_s / elapsed,
            "cuda_mallocs": torch.cuda.memory_stats().get("segment.all.allocated", 0),
            "cache_flushes": torch.cuda.memory_stats().get("num_alloc_retries", 0),
        }
        print(
            f"RESULT decoder memory over {args.mix_batches} fleet-like batches: allocator held "
            f"{mix['reserved_mib']:.0f} MiB at most, {mix['allocated_mib']:.0f} MiB in tensors; "
            f"{mix['audio_s_per_s']:.0f} audio-s/s; {mix['cuda_mallocs']} cudaMallocs, "
            f"{mix['cache_flushes']} cache flushes",
            flush=True,
        )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"decoder_memory{'_limit' if limited else ''}.json"
        (out / name).write_text(
            json.dumps(
                {"device": args.device, "limit": limited, "per_frame_bytes": per_frame, "mix": mix}, indent=2
            )
        )
    return 0


def fleet_windows(
    uniform: bool, count: int, chunk_frames: int | None = None
) -> list[tuple[object, int, int]]:
    """The 4 x 400 bench workload's windows (frames, left, right), random codes, shuffled as a decoder
    meets them with hundreds of segments in flight; ``count`` of them, the same ones for both cuts;
    ``chunk_frames`` new frames a chunk (unset: the setting's default)."""
    import random

    import numpy as np

    from bench.fleet_vs_vllm import book
    from fleet.settings import Settings
    from jobs.service import JobRequest, tasks_for, validate
    from models.orpheus import orpheus_family
    from workers.ar import StreamingConfig

    family = orpheus_family(name="orpheus")
    settings = Settings(uniform_windows=uniform, **({"chunk_frames": chunk_frames} if chunk_frames else {}))
    streaming = StreamingConfig.from_settings(settings, family)  # the family's context: LEFT / RIGHT
    rng = np.random.default_rng(0)
    windows = []
    for j in range(4):
        job, plan = validate(JobRequest(text=book(j, 400), model="tiny"), settings)
        for task in tasks_for(job, plan):
            chunker = streaming.chunker(family.layout, task.segment)
            codes = rng.integers(0, 4096, size=(family.max_frames(task.text), 7)).astype(np.int32)
            cut = chunker.feed(family.layout.frames_to_tokens(codes)) + chunker.finish()
            windows += [(w.frames, w.left, w.right) for w in cut]
    random.Random(0).shuffle(windows)
    return windows[:count]


def plan_summary(codec, windows: list, size: int) -> dict[str, float]:
    """How ``codec`` batches ``windows`` read ``size`` at a time (SnacCodec.plan): passes through the
    decoder's first block and through the rest per read, frames through the rest per new frame."""
    plans = [codec.plan(windows[i : i + size]) for i in range(0, len(windows), size)]
    new = sum(w[0].shape[0] - w[1] - w[2] for w in windows)
    return {
        "front_passes_a_read": sum(len(p.front) for p in plans) / len(plans),
        "back_passes_a_read": sum(len(p.back) for p in plans) / len(plans),
        "back_frames_a_new_frame": sum(p.back_frames() for p in plans) / new,
    }


def device_seconds(codec, windows: list, size: int) -> tuple[float, float, str]:
    """Decode ``windows`` read ``size`` at a time under torch.profiler: the kernels' time (on the CPU
    the operators' own time), the seconds of new audio and the profiler's table of where that time
    went. Beside AR engines on one GPU this, not the wall time (which includes launching each pass's
    kernels), is what the decoder takes from them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.device_time import device_microseconds

    on_gpu = codec.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    audio = 0
    with profile(activities=activities) as prof:
        for i in range(0, len(windows), size):
            audio += sum(len(a) for a in codec.decode_windows(windows[i : i + size]))
        if on_gpu:
            torch.cuda.synchronize()
    events = prof.key_averages()
    if on_gpu:
        busy_us = device_microseconds(events)
    else:
        busy_us = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::"))
    by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    table = events.table(sort_by=by, row_limit=30, max_name_column_width=90)
    return busy_us / 1e6, audio / codec.sample_rate, table


def window_mix(args) -> int:
    import torch
    from snac import SNAC

    from fleet.settings import Settings
    from models.snac_codec import SNAC_24KHZ_CONFIG, SnacCodec

    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = SNAC(**SNAC_24KHZ_CONFIG).eval()
    # the same weights: whole windows (as before decoder_cut_windows), cut ones as the fleet groups
    # them, and cut ones grouped with other costs of a pass (--pass-costs; 0: the fewest frames)
    decodes: dict[str, dict] = {"whole": {"cut": False}, "cut": {"cut": True}}
    for cost in [float(c) for c in args.pass_costs.split(",") if c]:
        decodes[f"cut@{cost:g}"] = {"cut": True, "pass_cost_frames": cost}
    codecs = {
        decode: SnacCodec(model, LEVELS, device=args.device, compile=args.compile, dtype=dtype, **kwargs)
        for decode, kwargs in decodes.items()
    }
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    cuts = {
        "uneven": fleet_windows(False, args.window_count),
        "uniform": fleet_windows(True, args.window_count),
    }
    # uniform windows of longer chunks: fewer windows, so less context decoded again a new frame
    for frames in [int(c) for c in args.chunk_frames.split(",") if c]:
        cuts[f"uniform/{frames}"] = fleet_windows(True, args.window_count, chunk_frames=frames)
    for name, windows in cuts.items():
        lengths = [w[0].shape[0] for w in windows]
        print(
            f"RESULT windows {name}: {len(windows)} windows, {sum(lengths)} frames decoded for "
            f"{sum(n - left - right for n, (_, left, right) in zip(lengths, windows, strict=True))} new, "
            f"{len(set(lengths))} lengths",
            flush=True,
        )
    runs = [(name, decode) for name in cuts for decode in codecs]
    planners = {"timed": codecs}  # and, on the CPU (one window a pass), as a GPU decoder batches
    if not args.device.startswith("cuda"):
        planners["as on a GPU"] = {
            decode: SnacCodec(model, LEVELS, max_batch=256, max_frames=Settings().decode_max_frames, **kwargs)
            for decode, kwargs in decodes.items()
        }
    results: dict[str, dict[int, list[float]]] = {f"{name} {decode}": {} for name, decode in runs}
    device: dict[str, dict[int, float]] = {f"{name} {decode}": {} for name, decode in runs}
    shapes: dict[str, dict[int, dict[str, dict[str, float]]]] = {
        f"{name} {decode}": {} for name, decode in runs
    }
    for size in [int(r) for r in args.read_sizes.split(",")]:
        for (name, decode), (planner, plan_codecs) in itertools.product(runs, planners.items()):
            shapes[f"{name} {decode}"].setdefault(size, {})[planner] = plan = plan_summary(
                plan_codecs[decode], cuts[name], size
            )
            print(
                f"RESULT windows {name} {decode}, reads of {size}, batched {planner}: "
                f"{plan['front_passes_a_read']:.2f} passes through the first block a read, "
                f"{plan['back_passes_a_read']:.2f} through the rest, "
                f"{plan['back_frames_a_new_frame']:.3f} frames through the rest a new frame",
                flush=True,
            )
        if args.plan_only:
            continue
        for repeat in range(args.repeats + 1):  # the first: warm-up (compilation, allocator)
            for name, decode in runs:
                windows, codec = cuts[name], codecs[decode]
                sync()
                started = time.perf_counter()
                audio = 0
                for i in range(0, len(windows), size):
                    audio += sum(len(a) for a in codec.decode_windows(windows[i : i + size]))
                sync()
                rate = audio / codec.sample_rate / (time.perf_counter() - started)
                if repeat:
                    results[f"{name} {decode}"].setdefault(size, []).append(rate)
        if args.device_time:
            for name, decode in runs:
                busy, audio, table = device_seconds(codecs[decode], cuts[name], size)
                device[f"{name} {decode}"][size] = busy
                if args.out:  # where the kernels' time goes, for each variant
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    table_path = (
                        Path(args.out) / f"kernels-{name.replace('/', '-')}-{decode}-reads-of-{size}.txt"
                    )
                    table_path.write_text(table)
                print(
                    f"RESULT windows {name} {decode}, reads of {size}: {busy:.3f} s of device time for "
                    f"{audio:.0f} s of new audio ({audio / busy:.0f}x real time a device-second)",
                    flush=True,
                )
        median = {key: statistics.median(rates[size]) for key, rates in results.items()}
        for key, rates in results.items():
            print(
                f"RESULT windows {key}, reads of {size}: {median[key]:.1f} new audio-s/s "
                f"(median of {args.repeats}: {', '.join(f'{r:.1f}' for r in rates[size])})",
                flush=True,
            )
        for decode in codecs:
            ratio = median[f"uniform {decode}"] / median[f"uneven {decode}"]
            print(f"RESULT windows uniform / uneven, {decode}, reads of {size}: x{ratio:.3f}", flush=True)
            for name in [n for n in cuts if n.startswith("uniform/")]:
                ratio = median[f"{name} {decode}"] / median[f"uniform {decode}"]
                print(f"RESULT windows {name} / uniform, {decode}, reads of {size}: x{ratio:.3f}", flush=True)
        for name, decode in itertools.product(cuts, codecs):
            if decode != "whole":
                ratio = median[f"{name} {decode}"] / median[f"{name} whole"]
                print(f"RESULT windows {decode} / whole, {name}, reads of {size}: x{ratio:.3f}", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decoder_windows.json").write_text(
            json.dumps(
                {
                    "device": args.device,
                    "compile": args.compile,
                    "cudnn_benchmark": args.cudnn_benchmark,
                    "bf16": args.bf16,
                    "rates": results,
                    "passes": shapes,
                    "device_seconds": device,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
