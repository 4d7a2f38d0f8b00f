"""Llasa (HKUSTAudio Llasa-1B/3B/8B): a Llama-3 LM emitting one XCodec2 code per 20 ms frame.

Token layout (Llama-3's 128,256 text tokens, then 8 special tokens, then the speech tokens):

- 128256..128263: ``<|TEXT_GENERATION_START|>``, ``<|TEXT_GENERATION_END|>``,
  ``<|TEXT_UNDERSTANDING_START|>``, ``<|TEXT_UNDERSTANDING_END|>``, ``<|SPEECH_GENERATION_START|>``,
  ``<|SPEECH_GENERATION_END|>`` (the stop token), ``<|SPEECH_UNDERSTANDING_START|>``,
  ``<|SPEECH_UNDERSTANDING_END|>``;
- ``<|s_N|>`` = id 128264 + N, N in 0..65535: code N of XCodec2's single codebook (an FSQ of 65,536
  values). Vocabulary 193,800. One code is one frame: 50 frames per second of 16 kHz audio.

Prompt (a Llama-3 chat turn): ``<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n
Convert the text to speech:<|TEXT_UNDERSTANDING_START|>{text}<|TEXT_UNDERSTANDING_END|><|eot_id|>
<|start_header_id|>assistant<|end_header_id|>\\n\\n<|SPEECH_GENERATION_START|>``; generation ends with
``<|SPEECH_GENERATION_END|>``. Llasa has no named speakers (it clones a voice from reference audio,
not supported here): the family has one voice, ``default``.

XCodec2 itself is not a dependency of this project, so no real Llasa checkpoint is registered; the
``tiny-llasa`` model pairs this layout with a real single-codebook codec that loads from a local
directory (the snac package's SNAC with one codebook at 16 kHz, hop 320 = 50 frames per second).
docs/models.md has the tables.
"""

from __future__ import annotations

from models.family import CodecLMFamily, SamplingDefaults, TokenLayout

TEXT_VOCAB = 128_256
BEGIN_OF_TEXT = 128_000
END_OF_TEXT = 128_001
EOT = 128_009
SPECIAL_TOKENS = (
    "<|TEXT_GENERATION_START|>",
    "<|TEXT_GENERATION_END|>",
    "<|TEXT_UNDERSTANDING_START|>",
    "<|TEXT_UNDERSTANDING_END|>",
    "<|SPEECH_GENERATION_START|>",
    "<|SPEECH_GENERATION_END|>",
    "<|SPEECH_UNDERSTANDING_START|>",
    "<|SPEECH_UNDERSTANDING_END|>",
)
TEXT_UNDERSTANDING_START = TEXT_VOCAB + 2
TEXT_UNDERSTANDING_END = TEXT_VOCAB + 3
SPEECH_GENERATION_START = TEXT_VOCAB + 4
SPEECH_GENERATION_END = TEXT_VOCAB + 5
CODE_BASE = TEXT_VOCAB + len(SPECIAL_TOKENS)  # <|s_0|>
CODEBOOK_SIZE = 65_536
#: Vocabulary size of the released Llasa checkpoints.
VOCAB_SIZE = CODE_BASE + CODEBOOK_SIZE  # 193,800

LLASA_LAYOUT = TokenLayout(
    code_base=CODE_BASE,
    codebook_size=CODEBOOK_SIZE,
    codes_per_frame=1,
    position_stride=CODEBOOK_SIZE,
    stop_token_ids=(SPEECH_GENERATION_END,),
)

#: The user turn and the assistant header, as Llasa's inference writes them (special tokens by name:
#: the tokenizer maps them to their ids). The tokenizer adds <|begin_of_text|> in front.
PROMPT_TEXT = (
    "<|start_header_id|>user<|end_header_id|>\n\n"
    "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>{text}<|TEXT_UNDERSTANDING_END|><|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


def token_name(token_id: int) -> str:
    """The name of an id >= 128256 in Llasa's vocabulary."""
    if token_id < CODE_BASE:
        return SPECIAL_TOKENS[token_id - TEXT_VOCAB]
    return f"<|s_{token_id - CODE_BASE}|>"


def llasa_family(name: str = "llasa", **overrides) -> CodecLMFamily:
    values = dict(
        name=name,
        layout=LLASA_LAYOUT,
        samples_per_frame=320,
        sample_rate=16_000,
        prompt_prefix=(),
        prompt_text=PROMPT_TEXT,
        prompt_suffix=(SPEECH_GENERATION_START,),
        voices=("default",),
        default_voice="default",
        # Llasa's published inference: temperature 0.8, top-p 1 (no repetition penalty)
        sampling=SamplingDefaults(temperature=0.8, top_p=1.0, top_k=0, repetition_penalty=1.0),
        # ~15 characters per second of speech = ~3.3 frames per character; twice that as the bound
        max_frames_per_char=6.0,
        min_frames=50,
        codec_levels=((0,),),
    )
    values.update(overrides)
    return CodecLMFamily(**values)
