"""One exception tree for everything a user can see.

Every error carries a message that says what was wrong and, where there is one, a hint that says
what to do. Front doors render these; nothing here knows about HTTP or terminals, but each class
names the HTTP status that fits it so the server can map errors without a table of its own.
"""

from __future__ import annotations


class LocalLLMError(Exception):
    """Base of every error localllm raises on purpose."""

    status: int = 500

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


def brief(exc: Exception, hint: bool = True) -> str:
    """One line for a check or a request that failed: a LocalLLMError's message (with its hint in brackets unless
    `hint` is False), else the exception's text."""
    if not isinstance(exc, LocalLLMError):
        return str(exc)
    return f"{exc.message} ({exc.hint})" if hint and exc.hint else exc.message


class InvalidInput(LocalLLMError):
    """The request itself is wrong (bad parameter, bad name, bad grammar)."""

    status = 400


class InvalidModelName(InvalidInput):
    pass


class ModelNotFound(LocalLLMError):
    status = 404


class PullError(LocalLLMError):
    status = 502


class GatedRepo(PullError):
    status = 403


class RemoteNotFound(PullError):
    status = 404


class IntegrityError(PullError):
    """A downloaded or imported file does not match its expected hash or is not a GGUF."""


class DiskSpaceError(LocalLLMError):
    status = 507


class NotGGUF(InvalidInput):
    """A file that should be a GGUF model is missing, truncated or something else."""


class StoreError(LocalLLMError):
    pass


class StoreUserError(StoreError):
    """The store refused what was asked (a name that escapes its folders, a malformed digest)."""

    status = 400


class CorruptStore(StoreError):
    """The store on disk is damaged: an unreadable manifest, a file a name points at is missing."""

    status = 500


class ModelInUse(StoreError):
    status = 409


class ModelLoadError(LocalLLMError):
    status = 500


class ContextOverflow(InvalidInput):
    """A prompt does not fit the context under the `error` policy."""

    def __init__(self, message: str, n_prompt: int, n_ctx: int, hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx


class Overloaded(LocalLLMError):
    status = 503


class EngineError(LocalLLMError):
    status = 500


class UpstreamError(LocalLLMError):
    """A remote model's upstream server failed the request (refused the connection, the key, or answered
    5xx); the message names the upstream."""

    status = 502


class UpstreamTimeout(UpstreamError):
    status = 504


class UpstreamUnsupported(InvalidInput):
    """The request needs something the remote model's upstream does not serve (e.g. /infill on vLLM)."""
