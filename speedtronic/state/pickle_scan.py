"""Reading an untrusted pickle without running it: which globals it names, and what a
refusal to load it means.

``restricted_load`` (``speedtronic.state.safe_load``) only ever unpickles with torch's
weights-only unpickler; when that refuses, ``classify_refusal`` decides why by scanning the
bytes with ``pickletools`` (a single bounded linear pass, no object is built): a
well-formed pickle stream that references anything the safe unpickler would not build is
*unsafe* (``UnsafeCheckpointError``: tampering, never stepped over silently), bytes that are
not a pickle at all are *damage* (``CorruptCheckpointError``: an older checkpoint may be
used instead).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import zipfile
from pathlib import Path
from typing import BinaryIO

from speedtronic.state.errors import CorruptCheckpointError, UnsafeCheckpointError, first_line

__all__ = ["classify_refusal", "pickled_globals"]

_FORBIDDEN_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def classify_refusal(
    name: str, source: Path | BinaryIO, exc: pickle.UnpicklingError
) -> CorruptCheckpointError | UnsafeCheckpointError:
    """What a weights-only refusal means: a well-formed pickle stream that the safe
    unpickler would not run is *unsafe* (any protocol, however deep the object sits); only
    a stream that is not a pickle at all is damage."""
    names = pickled_globals(_pickle_stream(source))
    if names is None:
        return CorruptCheckpointError(
            f"checkpoint {name} is unreadable (corrupt pickle data): {first_line(exc)}"
        )
    named = _FORBIDDEN_GLOBAL.search(str(exc))
    suspects = [global_ for global_ in names if global_.split(".")[0] not in _ROUTINE_MODULES]
    culprit = named.group(1) if named else (suspects or names or ["pickle opcodes"])[0]
    return UnsafeCheckpointError(
        f"refusing to load {name}: it contains a pickled Python object ({culprit}), and "
        "loading it could run arbitrary code. speedtronic checkpoints hold only tensors and "
        "plain data (torch.load weights_only=True). If you wrote this file yourself and "
        "trust it, convert it with torch.load(weights_only=False) in a separate script."
    )


_ROUTINE_MODULES = frozenset({"torch", "collections", "builtins", "_codecs", "numpy"})
"""Modules of the globals every checkpoint references (tensor rebuilds, OrderedDict): the
error names another one when there is one."""
_PICKLE_SCAN_LIMIT = 64 * 1024 * 1024


def _pickle_stream(source: Path | BinaryIO) -> bytes:
    """The object pickle of a checkpoint: ``data.pkl`` of a zip archive, else the start of
    the bytes (a plain or legacy-format pickle). Read only to explain a refusal; a stream
    (a record of a shard, whose view seeks only forward from its end) is read into memory
    first, bounded."""
    if not isinstance(source, Path):
        source.seek(0)
        source = io.BytesIO(source.read(_PICKLE_SCAN_LIMIT))
    try:
        with zipfile.ZipFile(source) as archive:
            pickles = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"]
            if pickles:
                with archive.open(min(pickles, key=len)) as record:
                    return record.read(_PICKLE_SCAN_LIMIT)
    except Exception:  # not a zip archive: the bytes themselves are the pickle
        pass
    if isinstance(source, Path):
        with open(source, "rb") as handle:
            return handle.read(_PICKLE_SCAN_LIMIT)
    return source.getvalue()


_STRING_ARGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})


def pickled_globals(stream: bytes) -> list[str] | None:
    """The ``module.name`` globals a pickle stream references, in order; ``None`` when the
    bytes are not one well-formed pickle (bounded: a single linear pass, no objects built)."""
    names: list[str] = []
    memo: dict[object, object] = {}
    recent: list[object] = []  # the arguments of the last pushes (for STACK_GLOBAL)
    try:
        for opcode, arg, _ in pickletools.genops(stream):
            if opcode.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL":
                module, global_name = ([None, None, *recent])[-2:]
                names.append(f"{module}.{global_name}")
            elif opcode.name in _MEMO_PUTS or opcode.name == "MEMOIZE":
                key = len(memo) if opcode.name == "MEMOIZE" else arg
                memo[key] = recent[-1] if recent else None
                continue
            elif opcode.name in _MEMO_GETS:
                recent = [*recent[-1:], memo.get(arg)]
                continue
            recent = [*recent[-1:], arg if opcode.name in _STRING_ARGS else None]
    except Exception:  # ValueError for unknown opcodes, truncation, bad arguments
        return None
    return names
