"""What the job service refuses or cannot serve, in domain terms (the HTTP layer maps each to a status:
api/errors.py). Every message says why, in words a user can act on."""

from __future__ import annotations

#: The most characters of a client's value an error message quotes.
QUOTE_LIMIT = 100


def quoted(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr`` of a client's value for an error message, cut to ``limit`` characters."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


class JobError(Exception):
    """Base of the job service's refusals."""


class InvalidRequest(JobError):
    """The request asks for something this fleet cannot do (an unknown voice, an empty text...)."""


class TooLarge(InvalidRequest):
    """The request is over a size limit (the text's length)."""


class InvalidEventId(InvalidRequest):
    """A resume point that is not an event id of this API."""


class JobNotFound(JobError):
    """No such job (never created, deleted, or expired)."""


class NotReady(JobError):
    """What was asked for exists only later in the job's life (its audio, before it is done)."""


class QuotaExceeded(JobError):
    """The tenant is over one of its limits (requests a minute, characters a day, concurrent jobs)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = max(int(retry_after_s), 1)


class NotDurable(JobError):
    """The job could not be stored as safely as the fleet is set to (no replica acknowledged it in
    time); nothing of it was kept (an HTTP 503: try again)."""

    retry_after_s = 5


class UnsupportedFile(InvalidRequest):
    """An uploaded file of a kind this service does not read (an HTTP 415)."""


class LexiconNotFound(JobNotFound):
    """No lexicon of that name for this tenant (a 404)."""
