"""TensorBoard's event-file reader, as far as speedtronic's tests use it."""

from collections.abc import Mapping
from typing import NamedTuple, TypedDict

from tensorboard.compat.proto.tensor_pb2 import TensorProto

class ScalarEvent(NamedTuple):
    wall_time: float
    step: int
    value: float

class TensorEvent(NamedTuple):
    wall_time: float
    step: int
    tensor_proto: TensorProto

class _Tags(TypedDict):
    images: list[str]
    audio: list[str]
    histograms: list[str]
    scalars: list[str]
    distributions: list[str]
    tensors: list[str]
    graph: bool
    meta_graph: bool
    run_metadata: list[str]

class EventAccumulator:
    path: str
    def __init__(
        self,
        path: str,
        size_guidance: Mapping[str, int] | None = ...,
        compression_bps: object = ...,
        purge_orphaned_data: bool = ...,
    ) -> None: ...
    def Reload(self) -> EventAccumulator: ...
    def Tags(self) -> _Tags: ...
    def Scalars(self, tag: str) -> list[ScalarEvent]: ...
    def Tensors(self, tag: str) -> list[TensorEvent]: ...
