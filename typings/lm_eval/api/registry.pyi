from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

def register_model(*names: str) -> Callable[[T], T]: ...
