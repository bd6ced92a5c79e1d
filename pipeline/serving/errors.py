"""The one error a bad request raises in the serving layer (imports nothing)."""


class RequestError(ValueError):
    """A bad request field; the message names the field and the fix. The models turn it into an INVALID_ARG
    error response and keep serving."""

    def __init__(self, field_name: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field_name, problem, fix
        super().__init__(f"{field_name}: {problem}; fix: {fix}")
