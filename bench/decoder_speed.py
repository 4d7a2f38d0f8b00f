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
- ``fleet_bf16``: the same under bfloat16 autocast (--bf16; not bit-identical to fp32).
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

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
    if args.bf16:

        def bf16(frames):
            with torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16):
                return codec.decode_frames(frames)

        variants["fleet_bf16"] = bf16
    if args.compile:  # as NARRATE_DECODER_COMPILE=1 runs it (dynamic shapes)
        variants["fleet_compiled"] = SnacCodec(
            model(), LEVELS, device=args.device, compile=True
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


if __name__ == "__main__":
    raise SystemExit(main())
