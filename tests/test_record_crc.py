"""A save's CRC-32s are computed as the bytes are written and stored where torch stores them."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from speedtronic.state import archive
from speedtronic.state.archive import archive_checksum, atomic_torch_save, load_checkpoint_file
from speedtronic.state.record_check import locate_records
from speedtronic.state.record_crc import CrcWriter, store_crcs

torch.set_num_threads(1)

_RANDOM_RECORD = "archive/.data/serialization_id"  # torch writes a random id into each save


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(64, 32),
        "t": torch.randn(16, 8).t(),  # not contiguous: torch writes its storage
        "empty": torch.empty(0),
        "ints": torch.arange(100, dtype=torch.int64),
        "plain": {"step": 3, "name": "x", "values": [1.5, None]},
    }


def _torch_archive(state: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)  # torch's CRC-32s on (its default)
    return buffer.getvalue()


def _index(data: bytes) -> list[tuple[str, int, int, int, int, int]]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [
            (i.filename, i.header_offset, i.compress_size, i.file_size, i.CRC, i.flag_bits)
            for i in zf.infolist()
            if i.filename != _RANDOM_RECORD
        ]


def _without_random_record(data: bytes) -> bytes:
    """``data`` with the random record's bytes and its two stored CRC-32s (data descriptor
    and central directory) zeroed: what two saves of one state have in common."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        info = zf.getinfo(_RANDOM_RECORD)
        (record,), _ = locate_records(io.BytesIO(data), [info], len(data))
    crc = struct.pack("<I", info.CRC)
    assert data.count(crc) == 2
    blank = bytearray(data.replace(crc, bytes(4)))
    blank[record.start : record.start + record.size] = bytes(record.size)
    return bytes(blank)


def test_a_save_is_the_archive_torch_writes_with_its_own_crc32s(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "step_000000000001.pt"
    atomic_torch_save(state, path)
    ours, theirs = path.read_bytes(), _torch_archive(state)
    assert _index(ours) == _index(theirs)
    assert _without_random_record(ours) == _without_random_record(theirs)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # zipfile checks every record against its CRC-32
        assert all(info.CRC != 0 for info in zf.infolist() if info.file_size > 0)


def test_records_not_written_in_one_piece_are_read_back(tmp_path: Path) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        with open(tmp_path / "a.pt", "w+b") as handle:
            torch.save(_state(), handle)
            handle.flush()
            assert store_crcs(handle, {})  # no write's CRC-32 known: every record read back
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(tmp_path / "a.pt") as zf:
        assert zf.testzip() is None


def test_an_archive_laid_out_otherwise_is_left_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "a.pt"
    path.write_bytes(_torch_archive(_state()))  # its CRC-32s already stored: not the layout
    before = path.read_bytes()
    with open(path, "r+b") as handle:
        assert not store_crcs(handle, {})
    assert path.read_bytes() == before
    path.write_bytes(b"not a zip archive")
    with open(path, "r+b") as handle:
        assert not store_crcs(handle, {})


def test_the_writer_keeps_each_writes_crc32_by_its_offset() -> None:
    buffer = io.BytesIO()
    writer = CrcWriter(buffer)
    writer.write(b"abc")
    writer.seek(10)
    writer.write(memoryview(b"defg"))
    assert writer.tell() == 14
    assert set(writer.crcs) == {0, 10}
    assert writer.crcs[10] == (4, zlib.crc32(b"defg"))
    writer.seek(1)
    writer.write(b"x")  # over bytes written before: no CRC-32 kept can be trusted
    assert writer.crcs == {}
    assert buffer.getvalue()[:3] == b"axc"


@pytest.mark.parametrize("case", ["unknown layout", "no isal"])
def test_a_save_falls_back_to_torchs_crc32s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    if case == "unknown layout":
        monkeypatch.setattr(archive, "store_crcs", lambda handle, crcs: False)
    else:
        monkeypatch.setattr(archive, "fast_crc32", lambda: False)
    state = _state()
    path = tmp_path / "step_000000000001.pt"
    checksum = atomic_torch_save(state, path)
    assert _index(path.read_bytes()) == _index(_torch_archive(state))
    assert checksum == archive_checksum(path)
    loaded = load_checkpoint_file(path, checksum=checksum)
    assert torch.equal(loaded["w"], state["w"])  # type: ignore[arg-type]


def test_torchs_crc32_switch_is_off_only_until_torch_opens_the_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []

    class Watching(CrcWriter):
        def write(self, data: bytes | bytearray | memoryview) -> int:
            written = super().write(data)
            seen.append(torch.serialization.get_crc32_options())  # another thread's view
            return written

    monkeypatch.setattr(archive, "CrcWriter", Watching)
    atomic_torch_save(_state(), tmp_path / "step_000000000001.pt")
    assert seen and all(seen)
    assert not archive._CRC32_SWITCH.locked()


def test_a_failed_save_sets_torchs_crc32_switch_back(tmp_path: Path) -> None:
    class Unpicklable:
        def __reduce__(self) -> tuple[object, ...]:
            raise RuntimeError("no")

    with pytest.raises(Exception, match="no"):
        atomic_torch_save({"x": Unpicklable()}, tmp_path / "step_000000000001.pt")
    assert torch.serialization.get_crc32_options() is True
    assert not archive._CRC32_SWITCH.locked()
    assert not list(tmp_path.iterdir())  # the temporary file is gone
