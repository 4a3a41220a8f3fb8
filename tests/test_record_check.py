"""The CRC-32 check of a checkpoint's tensor records runs on the bytes ``torch.load`` reads."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from speedtronic.state import archive
from speedtronic.state.archive import atomic_torch_save, load_checkpoint_file
from speedtronic.state.errors import CorruptCheckpointError
from speedtronic.state.record_check import CheckingReader, locate_records

torch.set_num_threads(1)


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "step_000000000001.pt"
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3), "step": 1}
    atomic_torch_save(state, path)
    return path


def _flip(path: Path, record_suffix: str) -> None:
    with zipfile.ZipFile(path) as zf, open(path, "rb") as handle:
        info = next(i for i in zf.infolist() if i.filename.endswith(record_suffix))
        located, _ = locate_records(handle, [info], path.stat().st_size)
    data = bytearray(path.read_bytes())
    data[located[0].start + located[0].size // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_torch_load_reads_every_tensor_record_through_the_checking_reader(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with zipfile.ZipFile(path) as zf, open(path, "rb", buffering=0) as handle:
        stored = [i for i in zf.infolist() if "/data/" in i.filename]
        located, broken = locate_records(handle, stored, path.stat().st_size)
        assert len(located) == 2 and not broken
        reader = CheckingReader(handle, located)
        state = torch.load(reader, map_location="cpu", weights_only=True)
    assert torch.equal(state["w"], torch.arange(4096, dtype=torch.float32))
    assert reader.unchecked == [] and reader.failed == []  # checked on the way, no second read


def test_a_flipped_bit_in_a_tensor_record_is_found_while_loading(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    _flip(path, "/data/0")
    with pytest.raises(CorruptCheckpointError, match=r"record .*/data/0 fails its integrity check"):
        load_checkpoint_file(path)


def test_a_damaged_pickle_is_found_before_anything_is_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _saved(tmp_path)
    _flip(path, "data.pkl")
    calls: list[object] = []
    monkeypatch.setattr(archive, "restricted_load", lambda *a, **k: calls.append(a))
    with pytest.raises(CorruptCheckpointError, match="data.pkl fails its integrity check"):
        load_checkpoint_file(path)
    assert calls == []


def test_a_tensor_record_torch_did_not_read_whole_is_still_checked(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    _flip(path, "/data/0")
    with zipfile.ZipFile(path) as zf, open(path, "rb", buffering=0) as handle:
        stored = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
        located, _ = locate_records(handle, stored, path.stat().st_size)
        reader = CheckingReader(handle, located)
        reader.seek(located[0].start)
        reader.read(16)  # a partial read checks nothing
        assert reader.unchecked == located and reader.failed == []


def test_the_crc32_is_zlibs_checksum_and_chains() -> None:
    import zlib

    from speedtronic.state.record_check import crc32

    data = bytes(range(256)) * 1000
    assert crc32(data) == zlib.crc32(data)
    assert crc32(memoryview(data)[1000:], crc32(data[:1000])) == zlib.crc32(data)
