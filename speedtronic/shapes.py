"""The 2.0 import path; the code lives in ``speedtronic.systems.shapes``."""

from speedtronic.systems.shapes import (
    CUDA_MIXED_PRECISION_ALIGNMENT as CUDA_MIXED_PRECISION_ALIGNMENT,
)
from speedtronic.systems.shapes import ShapeConfig as ShapeConfig
from speedtronic.systems.shapes import ShapeDataSettings as ShapeDataSettings
from speedtronic.systems.shapes import ShapeModelSettings as ShapeModelSettings
from speedtronic.systems.shapes import ShapeProfile as ShapeProfile
from speedtronic.systems.shapes import ShapeReport as ShapeReport
from speedtronic.systems.shapes import ShapeValidationSettings as ShapeValidationSettings
from speedtronic.systems.shapes import ShapeWarning as ShapeWarning
from speedtronic.systems.shapes import WarningLogger as WarningLogger
from speedtronic.systems.shapes import resolve_shape_profile as resolve_shape_profile
from speedtronic.systems.shapes import validate_startup_shapes as validate_startup_shapes

__all__ = [
    "CUDA_MIXED_PRECISION_ALIGNMENT",
    "ShapeConfig",
    "ShapeDataSettings",
    "ShapeModelSettings",
    "ShapeProfile",
    "ShapeReport",
    "ShapeValidationSettings",
    "ShapeWarning",
    "WarningLogger",
    "resolve_shape_profile",
    "validate_startup_shapes",
]
