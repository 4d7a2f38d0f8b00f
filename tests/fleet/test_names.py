"""The stage streams' names in shards (fleet/names.py): each shard its own hash tag, i.e. its own Redis
Cluster slot; a shard's code-chunk stream in its task stream's slot, under another name."""

from __future__ import annotations

from redis.crc import key_slot

from fleet.names import Names


def slot(key: str) -> int:
    return key_slot(key.encode())


def test_each_shard_of_a_stage_stream_is_a_slot_of_its_own():
    names = Names("narrate")
    shards = range(3)
    for stream in (lambda s: names.tasks("tiny", s), lambda s: names.codes("tiny", s), names.audio):
        assert len({slot(stream(s)) for s in shards}) == 3
    for s in shards:
        assert names.codes("tiny", s) != names.tasks("tiny", s)
        assert slot(names.codes("tiny", s)) == slot(names.tasks("tiny", s))  # a job's: one primary
    assert names.codes("tiny", 1) == "narrate:codes:{tiny.1}"
    assert names.audio(1) == "narrate:audio:{narrate.a1}"
    assert names.codes("tiny") == names.codes("tiny", 0) and names.audio() == names.audio(0)


def test_stage_streams_are_every_stream_of_every_shard():
    names = Names("p")
    streams = names.stage_streams(["tiny", "espeak"], 2)
    assert sorted(streams) == sorted(
        [names.tasks(m, s) for m in ("tiny", "espeak") for s in (0, 1)]
        + [names.codes(m, s) for m in ("tiny", "espeak") for s in (0, 1)]
        + [names.audio(0), names.audio(1)]
    )
    assert len(set(streams)) == len(streams) == 10
