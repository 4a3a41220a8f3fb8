"""The 2.0 import path; the code lives in ``speedtronic.systems.precision`` (and
``parameter_count`` in ``speedtronic.models.summary``, the one count of a model's parameters)."""

from speedtronic.models.summary import parameter_count as parameter_count
from speedtronic.systems.precision import PrecisionPlan as PrecisionPlan
from speedtronic.systems.precision import PrecisionSettings as PrecisionSettings
from speedtronic.systems.precision import autocast_context as autocast_context
from speedtronic.systems.precision import make_grad_scaler as make_grad_scaler
from speedtronic.systems.precision import resolve_device as resolve_device
from speedtronic.systems.precision import resolve_precision as resolve_precision
from speedtronic.systems.precision import supports_fused_adamw as supports_fused_adamw

__all__ = [
    "PrecisionPlan",
    "PrecisionSettings",
    "autocast_context",
    "make_grad_scaler",
    "parameter_count",
    "resolve_device",
    "resolve_precision",
    "supports_fused_adamw",
]
