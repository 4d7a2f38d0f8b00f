"""What the job service refuses or cannot serve, in domain terms (the HTTP layer maps each to a status:
api/errors.py). Every message says why, in words a user can act on."""

from __future__ import annotations


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
