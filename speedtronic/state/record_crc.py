"""Storing a ``torch.save`` archive's CRC-32s computed on the bytes as they are written.

``torch.save`` computes the CRC-32 of every record with its own routine, about 5 GB/s on the
development VM: 70 ms of a 352 MiB save, a quarter of its CPU time. ISA-L's (``isal``, the
one ``record_check`` verifies loads with) does the same in about 15 ms. So a save runs
``torch.save`` with its CRC-32s switched off into ``CrcWriter``, which takes the CRC-32 of
every write on the buffer torch hands it (no copy, no second pass over the data), and
``store_crcs`` then writes each record's value into the two places a zip archive keeps it:
the record's data descriptor (or its local header, without one) and its central-directory
entry -- the fields torch leaves zero. The archive is then byte for byte what ``torch.save``
with its CRC-32s writes (``tests/test_record_crc.py``).

Nothing here trusts the write pattern for correctness: a record whose bytes did not arrive
in one write is read back for its CRC-32, and an archive whose layout is not the expected
one (a field that is not zero, a signature missing) is reported (``store_crcs`` returns
``False``) before anything in it is changed, for the caller to write it again with torch's
own CRC-32s.
"""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Callable
from typing import BinaryIO

from speedtronic.state.record_check import StoredRecord, crc32, locate_records

__all__ = ["CrcWriter", "store_crcs"]

_CENTRAL = struct.Struct("<4s12xI8xHHH12x")  # signature, CRC-32, name/extra/comment lengths
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_CENTRAL_CRC = 16  # offset of the CRC-32 in a central-directory entry
_LOCAL_CRC = 14  # ... in a local header
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_HAS_DESCRIPTOR = 0x08  # general-purpose flag bit 3: sizes and CRC-32 follow the data
_READ_CHUNK = 16 * 1024 * 1024


class CrcWriter:
    """The file ``torch.save`` writes to: passes every write on to ``handle`` and keeps the
    CRC-32 of its bytes by the offset it starts at (``crcs``: offset -> (length, CRC-32);
    none once a write went over bytes written before, which may have changed a CRC-32 kept).
    ``on_first_write`` is called before the first write: torch has opened the archive."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._position = self._end = handle.tell()
        self._crcs: dict[int, tuple[int, int]] = {}
        self._overwritten = False
        self.on_first_write: Callable[[], None] | None = None

    @property
    def crcs(self) -> dict[int, tuple[int, int]]:
        return {} if self._overwritten else self._crcs

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self.on_first_write is not None:
            opened, self.on_first_write = self.on_first_write, None
            opened()
        with memoryview(data) as view:
            length = view.nbytes
            # Before the write, on the buffer that is written: what the file gets.
            self._crcs[self._position] = (length, crc32(view))
        self._handle.write(data)
        self._overwritten |= self._position < self._end
        self._position += length
        self._end = max(self._end, self._position)
        return length

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._position = self._handle.seek(offset, whence)
        return self._position

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        self._handle.flush()


def store_crcs(handle: BinaryIO, crcs: dict[int, tuple[int, int]]) -> bool:
    """Write every record's CRC-32 into the archive in ``handle`` (flushed, readable and
    writable), from ``crcs`` (``CrcWriter.crcs``) where a write held exactly its bytes,
    else computed from the file. ``False``, with nothing changed, when the archive is not
    laid out as ``torch.save`` writes it with its CRC-32s switched off."""
    handle.seek(0)
    try:
        archive = zipfile.ZipFile(handle)
    except zipfile.BadZipFile:
        return False
    with archive:
        infos = archive.infolist()
        directory_start = archive.start_dir
    if any(info.compress_type != zipfile.ZIP_STORED for info in infos):
        return False
    records, broken = locate_records(handle, infos, os.fstat(handle.fileno()).st_size)
    if broken:
        return False
    directory = _central_directory(handle, directory_start, infos)
    if directory is None:
        return False
    patches: list[tuple[int, bytes]] = []
    for info, record, entry in zip(infos, records, directory[1], strict=True):
        crc = _record_crc(handle, record, crcs)
        if info.flag_bits & _HAS_DESCRIPTOR:
            place = record.start + record.size
            if _read_at(handle, 8, place) != _DESCRIPTOR_SIGNATURE + bytes(4):
                return False
            place += 4
        else:
            place = info.header_offset + _LOCAL_CRC
            if _read_at(handle, 4, place) != bytes(4):
                return False
        value = struct.pack("<I", crc)
        patches.append((place, value))
        directory[0][entry + _CENTRAL_CRC : entry + _CENTRAL_CRC + 4] = value
    # Through the handle, as every read: its buffer must not keep the old bytes.
    for place, value in [*patches, (directory_start, bytes(directory[0]))]:
        handle.seek(place)
        handle.write(value)
    handle.flush()
    return True


def _read_at(handle: BinaryIO, size: int, place: int) -> bytes:
    handle.seek(place)
    return handle.read(size)


def _central_directory(
    handle: BinaryIO, start: int, infos: list[zipfile.ZipInfo]
) -> tuple[bytearray, list[int]] | None:
    """The central directory's bytes and each entry's offset in them, when every entry is
    where ``infos`` says, names its record and has a zero CRC-32; else ``None``."""
    size = sum(
        _CENTRAL.size + len(_raw_name(info)) + len(info.extra) + len(info.comment) for info in infos
    )
    data = bytearray(_read_at(handle, size, start))
    if len(data) != size:
        return None
    entries: list[int] = []
    offset = 0
    for info in infos:
        if offset + _CENTRAL.size > size:
            return None
        signature, crc, name, extra, comment = _CENTRAL.unpack_from(data, offset)
        name_at = offset + _CENTRAL.size
        if (
            signature != _CENTRAL_SIGNATURE
            or crc != 0
            or bytes(data[name_at : name_at + name]) != _raw_name(info)
        ):
            return None
        entries.append(offset)
        offset = name_at + name + extra + comment
    return data, entries


def _raw_name(info: zipfile.ZipInfo) -> bytes:
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


def _record_crc(handle: BinaryIO, record: StoredRecord, crcs: dict[int, tuple[int, int]]) -> int:
    written = crcs.get(record.start)
    if written is not None and written[0] == record.size:
        return written[1]
    crc, left = 0, record.size
    handle.seek(record.start)
    while left > 0:
        chunk = handle.read(min(left, _READ_CHUNK))
        if not chunk:
            break
        crc = crc32(chunk, crc)
        left -= len(chunk)
    return crc
