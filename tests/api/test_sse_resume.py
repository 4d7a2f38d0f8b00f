"""Resume ids (Last-Event-ID, ?after=): only a stream id (two 64-bit unsigned integers, ASCII digits)
resumes; anything else is the 400 of an invalid event id, never a 500 or a stream that cannot start."""

from __future__ import annotations

import pytest

from api.sse import resume_point
from jobs.errors import InvalidEventId

NOT_IDS = [
    "١-٠",  # Arabic-Indic digits: int() reads them, Redis does not
    "0-0\n",  # a trailing newline
    "1" * 5000 + "-0",  # past Python's int-from-string limit
    "0-" + "1" * 21,  # more digits than a 64-bit integer has
    str(2**64) + "-0",
    "-",
    "1-",
    "+1-0",
    " 1-0",
]


@pytest.mark.parametrize("resume", NOT_IDS)
def test_what_is_not_a_stream_id_is_an_invalid_event_id(resume):
    with pytest.raises(InvalidEventId, match="is not an event id of this API"):
        resume_point(resume, None)
    with pytest.raises(InvalidEventId, match="is not an event id of this API"):
        resume_point(None, resume)


def test_stream_ids_resume_up_to_the_largest():
    largest = f"{2**64 - 1}-{2**64 - 1}"
    assert resume_point(largest, None) == largest
    assert resume_point(None, "1712345678901-0") == "1712345678901-0"
    assert resume_point(None, None) == "0-0"


def test_the_events_route_answers_400_to_what_is_not_a_stream_id(api):
    async def scenario(a):
        job = (await a.client.post("/v1/jobs", json={"text": "Hello there."})).json()
        url = f"/v1/jobs/{job['id']}/events"
        query = [(await a.client.head(url, params={"after": bad})).status_code for bad in NOT_IDS]
        header = (await a.client.head(url, headers={"last-event-id": "1" * 5000 + "-0"})).status_code
        return query, header

    query, header = api(scenario)
    assert query == [400] * len(NOT_IDS) and header == 400
