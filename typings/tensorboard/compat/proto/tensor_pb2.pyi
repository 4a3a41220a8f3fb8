"""The parts of tensorboard's generated ``TensorProto`` protobuf that speedtronic uses."""

class TensorProto:
    @property
    def string_val(self) -> list[bytes]: ...
    @property
    def float_val(self) -> list[float]: ...
