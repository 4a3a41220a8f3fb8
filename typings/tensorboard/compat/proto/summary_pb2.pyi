"""The parts of tensorboard's generated ``Summary`` protobuf that speedtronic uses."""

from collections.abc import Iterable

class Summary:
    class Value:
        tag: str
        simple_value: float
        def __init__(self, *, tag: str = ..., simple_value: float = ...) -> None: ...

    @property
    def value(self) -> list[Summary.Value]: ...
    def __init__(self, *, value: Iterable[Summary.Value] | None = ...) -> None: ...
    def SerializeToString(self) -> bytes: ...
