"""The errors that end a request early in the serving layer (imports nothing); each becomes an error response."""


class RequestError(ValueError):
    """A bad request field; the message names the field and the fix. The models turn it into an INVALID_ARG
    error response and keep serving."""

    def __init__(self, field_name: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field_name, problem, fix
        super().__init__(f"{field_name}: {problem}; fix: {fix}")


class Unavailable(RuntimeError):
    """The server is shutting down (UNAVAILABLE): the client should retry on another replica."""


class Stopped(Exception):
    """The request was stopped before it finished: its client left, or the server's drain budget ran out."""
