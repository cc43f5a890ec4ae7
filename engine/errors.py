"""The client's errors the engine raises: plain Python, imported by the request types, the grammar
compiler and both front ends."""
from __future__ import annotations


class InvalidParam(ValueError):
    """A request field is out of its documented range: the client's error, naming the field.

    The front ends map it to 400 / INVALID_ARGUMENT with `field` as the parameter to blame.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
