"""The 2.0 import path; the code lives in ``speedtronic.state.checkpoint``."""

from speedtronic.state.checkpoint import BEST_POINTER_NAME as BEST_POINTER_NAME
from speedtronic.state.checkpoint import POINTER_NAME as POINTER_NAME
from speedtronic.state.checkpoint import BestCheckpoint as BestCheckpoint
from speedtronic.state.checkpoint import CheckpointError as CheckpointError
from speedtronic.state.checkpoint import CheckpointManager as CheckpointManager
from speedtronic.state.checkpoint import CorruptCheckpointError as CorruptCheckpointError
from speedtronic.state.checkpoint import LoadedCheckpoint as LoadedCheckpoint
from speedtronic.state.checkpoint import Pointer as Pointer
from speedtronic.state.checkpoint import SkippedCheckpoint as SkippedCheckpoint
from speedtronic.state.checkpoint import UnsafeCheckpointError as UnsafeCheckpointError
from speedtronic.state.checkpoint import archive_checksum as archive_checksum
from speedtronic.state.checkpoint import atomic_json_dump as atomic_json_dump
from speedtronic.state.checkpoint import atomic_torch_save as atomic_torch_save
from speedtronic.state.checkpoint import capture_rng_state as capture_rng_state
from speedtronic.state.checkpoint import checkpoint_step as checkpoint_step
from speedtronic.state.checkpoint import load_checkpoint_file as load_checkpoint_file
from speedtronic.state.checkpoint import parse_pointer as parse_pointer
from speedtronic.state.checkpoint import plain_state as plain_state
from speedtronic.state.checkpoint import requeue_exit_code as requeue_exit_code
from speedtronic.state.checkpoint import restore_rng_state as restore_rng_state
from speedtronic.state.checkpoint import signal_stop_reason as signal_stop_reason

__all__ = [
    "BEST_POINTER_NAME",
    "BestCheckpoint",
    "CheckpointError",
    "CheckpointManager",
    "CorruptCheckpointError",
    "LoadedCheckpoint",
    "POINTER_NAME",
    "Pointer",
    "SkippedCheckpoint",
    "UnsafeCheckpointError",
    "archive_checksum",
    "atomic_json_dump",
    "atomic_torch_save",
    "capture_rng_state",
    "checkpoint_step",
    "load_checkpoint_file",
    "parse_pointer",
    "plain_state",
    "requeue_exit_code",
    "restore_rng_state",
    "signal_stop_reason",
]
