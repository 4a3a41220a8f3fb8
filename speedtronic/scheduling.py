"""2.0's import path for out-of-order backprop's CUDA stage streams, kept for 2.0 code.

The implementation is ``speedtronic.systems.stage_streams`` (a module is named for what it holds).
"""

from __future__ import annotations

from speedtronic.systems.stage_streams import StageInfo, StageStreamScheduler

__all__ = ["StageInfo", "StageStreamScheduler"]
