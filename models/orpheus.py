"""Orpheus TTS: Llama-3.2-3B emitting SNAC 24 kHz codes as custom tokens.

Token layout (Llama-3 vocabulary of 128,256 text tokens, then Orpheus' custom tokens):
``<custom_token_N>`` is id ``128256 + N``; N = 10 + position * 4096 + code for the 7 positions of a
frame. A frame's positions feed SNAC's three levels as [0] -> level 0, [1, 4] -> level 1 and
[2, 3, 5, 6] -> level 2 (1 + 2 + 4 codes per 2048-sample frame, 85.3 ms at 24 kHz).
Prompt: ``<start_of_human> <|begin_of_text|> "voice: text" <|eot_id|> <end_of_human> <start_of_ai>
<start_of_speech>``; generation ends with ``<end_of_speech>``. docs/models.md has the full table.
"""

from __future__ import annotations

from models.family import CodecLMFamily, SamplingDefaults, TokenLayout

TEXT_VOCAB = 128_256
BEGIN_OF_TEXT = 128_000
EOT = 128_009
START_OF_SPEECH = TEXT_VOCAB + 1
END_OF_SPEECH = TEXT_VOCAB + 2
START_OF_HUMAN = TEXT_VOCAB + 3
END_OF_HUMAN = TEXT_VOCAB + 4
START_OF_AI = TEXT_VOCAB + 5
END_OF_AI = TEXT_VOCAB + 6
PAD = TEXT_VOCAB + 7
CODE_BASE = TEXT_VOCAB + 10
CODEBOOK_SIZE = 4096
CODES_PER_FRAME = 7
#: Vocabulary size of the released Orpheus 3B checkpoints.
VOCAB_SIZE = 156_940

VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")

ORPHEUS_LAYOUT = TokenLayout(
    code_base=CODE_BASE,
    codebook_size=CODEBOOK_SIZE,
    codes_per_frame=CODES_PER_FRAME,
    position_stride=CODEBOOK_SIZE,
    stop_token_ids=(END_OF_SPEECH,),
)


def orpheus_family(name: str = "orpheus", **overrides) -> CodecLMFamily:
    values = dict(
        name=name,
        layout=ORPHEUS_LAYOUT,
        samples_per_frame=2048,
        sample_rate=24_000,
        prompt_prefix=(START_OF_HUMAN,),
        prompt_suffix=(EOT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH),
        voices=VOICES,
        default_voice="tara",
        sampling=SamplingDefaults(temperature=0.6, top_p=0.8, top_k=0, repetition_penalty=1.3),
        codec_levels=((0,), (1, 4), (2, 3, 5, 6)),
    )
    values.update(overrides)
    return CodecLMFamily(**values)
