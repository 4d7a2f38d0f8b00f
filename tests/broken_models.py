"""Checkpoints made to misbehave, written in the real formats (for the runaway tests).

- ``repeating_checkpoint``: the tiny LM edited so that, whatever the context, code 0 of every frame
  position outweighs every other token by far: under the frame constraint it emits the frame
  [0, 0, 0, 0, 0, 0, 0] forever (a loop), and never the stop token.
The tiny LM itself never emits the stop token either: served as ``orpheus`` (whose family requires
one) it is a model that never stops.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models import orpheus


def repeating_checkpoint(tiny_dir: Path, target: Path) -> Path:
    """Zero every layer's output projections (the residual stream is the input embedding alone), give
    every embedding a constant first feature and read only that feature out (the final norm keeps
    dimension 0): all logits are equal, except code 0 of each position, 10x larger."""
    target.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(tiny_dir / "model.safetensors"))
    config = json.loads((tiny_dir / "config.json").read_text())
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embed = weights["model.embed_tokens.weight"]
    embed[:, 0] = 1.0
    for position in range(orpheus.CODES_PER_FRAME):
        embed[orpheus.CODE_BASE + position * orpheus.CODEBOOK_SIZE, 0] = 10.0
    norm = weights["model.norm.weight"]
    norm.zero_()
    norm[0] = 1.0
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for item in tiny_dir.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            copy = shutil.copytree if item.is_dir() else shutil.copy2
            copy(item, target / item.name)
    assert torch.equal(load_file(str(target / "model.safetensors"))["model.norm.weight"][1:], norm[1:])
    return target
