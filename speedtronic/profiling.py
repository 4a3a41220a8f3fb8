"""Old import path of the original API's metric logger; it lives in
``speedtronic.compat.metric_logger`` (the 2.0 shims are kept together in ``speedtronic.compat``)."""

from speedtronic.compat.metric_logger import CallbackList as CallbackList
from speedtronic.compat.metric_logger import Hook as Hook
from speedtronic.compat.metric_logger import HookFunction as HookFunction
from speedtronic.compat.metric_logger import Metric as Metric
from speedtronic.compat.metric_logger import MetricLogger as MetricLogger
from speedtronic.compat.metric_logger import MetricLoggerCallback as MetricLoggerCallback
from speedtronic.compat.metric_logger import Payload as Payload
from speedtronic.compat.metric_logger import ReportsCheckpoints as ReportsCheckpoints
from speedtronic.compat.metric_logger import TrainingHook as TrainingHook
from speedtronic.compat.metric_logger import call_hook as call_hook
from speedtronic.compat.metric_logger import memory_usage_bytes as memory_usage_bytes

__all__ = [
    "CallbackList",
    "Hook",
    "HookFunction",
    "Metric",
    "MetricLogger",
    "MetricLoggerCallback",
    "Payload",
    "ReportsCheckpoints",
    "TrainingHook",
    "call_hook",
    "memory_usage_bytes",
]
