"""The tiny models: real token layouts and codec shapes at test size, from a fixed seed.

``tiny`` has Orpheus' exact layout and SNAC 24 kHz's frame shape (below); ``tiny-llasa`` has Llasa's
exact layout (one code per frame) with a single-codebook 16 kHz SNAC as its codec
(``build_tiny_llasa_checkpoint``).

It is written to disk in the formats of the real thing, and loaded back through the same code a real
Orpheus download goes through:

- the LM: a Hugging Face Llama checkpoint (``save_pretrained``: config.json + model.safetensors) with
  Orpheus' vocabulary size (156,940) and 4 small layers;
- the tokenizer: a byte-level ``tokenizer.json`` with Llama-3's special-token ids and Orpheus'
  ``<custom_token_N>`` ids at their real positions;
- the codec: a SNAC 24 kHz model (same rates, codebooks and strides as ``hubertsiuzdak/snac_24khz``,
  narrower decoder), saved as the snac package saves one (``snac/config.json`` +
  ``snac/pytorch_model.bin``).

With random weights the LM emits arbitrary codes, so its audio is noise; the constrained sampler keeps
every code valid for its frame position.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from models import llasa, orpheus
from models.snac_codec import SNAC_24KHZ_CONFIG

TINY_SEED = 20261129
#: Bump when the builder changes, so stale builds on disk are not reused.
TINY_VERSION = 1

TINY_LM_CONFIG = dict(
    vocab_size=orpheus.VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    bos_token_id=orpheus.BEGIN_OF_TEXT,
    eos_token_id=orpheus.END_OF_SPEECH,
    pad_token_id=orpheus.PAD,
    torch_dtype="float32",
)

#: SNAC 24 kHz with narrow encoder/decoder: the same rates, codebooks and frame shape.
TINY_SNAC_CONFIG = {**SNAC_24KHZ_CONFIG, "encoder_dim": 16, "decoder_dim": 64}

#: The tiny-llasa LM: Llasa's vocabulary (193,800) on a smaller Llama than tiny's (the embedding
#: dominates its size: 99 MB in float32).
TINY_LLASA_VERSION = 1
TINY_LLASA_LM_CONFIG = dict(
    TINY_LM_CONFIG,
    vocab_size=llasa.VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    eos_token_id=llasa.SPEECH_GENERATION_END,
    pad_token_id=llasa.END_OF_TEXT,
)
#: A single-codebook codec at Llasa's rates: 16 kHz, hop 320 (50 frames per second), one codebook of
#: 65,536 codes (XCodec2's size) -- SNAC with vq_strides [1].
TINY_LLASA_CODEC_CONFIG = dict(
    sampling_rate=16000,
    encoder_dim=16,
    encoder_rates=[2, 4, 5, 8],
    latent_dim=None,
    decoder_dim=64,
    decoder_rates=[8, 5, 4, 2],
    attn_window_size=None,
    codebook_size=llasa.CODEBOOK_SIZE,
    codebook_dim=8,
    vq_strides=[1],
    noise=True,
    depthwise=True,
)

_LLAMA3_SPECIALS = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128009: "<|eot_id|>",
}


def _orpheus_token_name(token_id: int) -> str:
    return f"<custom_token_{token_id - 128256}>"


def build_tokenizer(
    directory: Path,
    vocab_size: int = orpheus.VOCAB_SIZE,
    token_name: Callable[[int], str] = _orpheus_token_name,
    added_specials: int = 0,
) -> None:
    """A byte-level tokenizer with Llama-3's special ids and the family's tokens from 128256 on
    (``token_name``; the first ``added_specials`` of them are special, i.e. matched by name in text),
    saved in Hugging Face's format."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    specials = {
        i: _LLAMA3_SPECIALS.get(i, f"<|reserved_special_token_{i - 128000}|>") for i in range(128000, 128256)
    }
    specials.update({i: token_name(i) for i in range(128256, 128256 + added_specials)})
    for i in range(len(vocab), vocab_size):
        vocab[specials.get(i) or (token_name(i) if i >= 128256 else f"<|filler_{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials.values()])
    bos = _LLAMA3_SPECIALS[128000]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, 128000)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=_LLAMA3_SPECIALS[128009],
        pad_token="<|reserved_special_token_4|>",
    )
    fast.save_pretrained(str(directory))


def build_lm(directory: Path, seed: int = TINY_SEED, config: dict = TINY_LM_CONFIG) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).float()
    model.save_pretrained(str(directory), safe_serialization=True)


def build_snac(directory: Path, seed: int = TINY_SEED, config: dict = TINY_SNAC_CONFIG) -> None:
    from snac import SNAC

    torch.manual_seed(seed)
    model = SNAC(**config)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(model.state_dict(), directory / "pytorch_model.bin")


def build_tiny_checkpoint(directory: Path, seed: int = TINY_SEED) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    build_lm(directory, seed)
    build_tokenizer(directory)
    build_snac(directory / "snac", seed)
    return directory


def build_tiny_llasa_checkpoint(directory: Path, seed: int = TINY_SEED) -> Path:
    """Llasa's exact token layout and tokenizer ids, a small Llama, and a single-codebook SNAC at
    16 kHz (one code per 320-sample frame) as the codec."""
    directory.mkdir(parents=True, exist_ok=True)
    build_lm(directory, seed, TINY_LLASA_LM_CONFIG)
    build_tokenizer(directory, llasa.VOCAB_SIZE, llasa.token_name, added_specials=len(llasa.SPECIAL_TOKENS))
    build_snac(directory / "snac", seed, TINY_LLASA_CODEC_CONFIG)
    return directory


def _ensure(data_dir: Path, name: str, build: Callable[[Path], Path]) -> Path:
    """A built checkpoint under ``data_dir``, built once (concurrent processes wait for the first)."""
    target = Path(data_dir) / "models" / name
    if (target / "snac" / "pytorch_model.bin").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "snac" / "pytorch_model.bin").exists():
            staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
            try:
                build(staging)
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_tiny_checkpoint(data_dir: Path) -> Path:
    """The tiny (Orpheus-layout) checkpoint under ``data_dir``."""
    return _ensure(data_dir, f"tiny-v{TINY_VERSION}-{TINY_SEED}", build_tiny_checkpoint)


def ensure_tiny_llasa_checkpoint(data_dir: Path) -> Path:
    """The tiny-llasa checkpoint under ``data_dir``."""
    return _ensure(data_dir, f"tiny-llasa-v{TINY_LLASA_VERSION}-{TINY_SEED}", build_tiny_llasa_checkpoint)
