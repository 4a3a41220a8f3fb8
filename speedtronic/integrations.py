"""Old import path of the original API's W&B/TensorBoard hooks; they live in
``speedtronic.compat.integrations``."""

from speedtronic.compat.integrations import TensorboardHook as TensorboardHook
from speedtronic.compat.integrations import WandbHook as WandbHook

__all__ = ["TensorboardHook", "WandbHook"]
