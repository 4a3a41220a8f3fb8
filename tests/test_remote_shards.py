"""Token shards in object storage (``data.tokens: s3://...``, ``file://...``): read through a
bounded local cache, verified on arrival, the same windows and exact resume as local shards.

Against a real S3 API: a ``moto`` server on a loopback port (dummy credentials in the
environment, the endpoint in ``data.storage_options``), uploaded with ``s3fs``. Faults are
real too: a damaged object, a missing one, a download killed half way (its source a FIFO the
test feeds, so the kill lands mid-file), and a cache on a disk that is full for the process
(``RLIMIT_FSIZE``: the kernel refuses the write).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time
import uuid
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest
import torch
from elastic_worker import elastic_config
from forked import Forked, cli_main
from sequential_shards import write_sequential_shards
from test_remote_checkpoint import s3_endpoint as s3_endpoint  # the loopback moto server

from speedtronic.config import SpeedtronicConfig
from speedtronic.data import BatchStream, build_dataloader
from speedtronic.data.remote_shards import RemoteShardOptions, open_remote_token_dataset
from speedtronic.data.shard_cache import ShardCache, ShardCacheFull
from speedtronic.data.shards import ShardError, read_manifest
from speedtronic.data.windows import open_token_dataset

BLOCK = 4
SHARDS = [(0, 401), (1000, 401), (2000, 401), (3000, 401)]  # 100 windows each
SHARD_BYTES = 401 * 2


@pytest.fixture
def bucket(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[str, dict[str, object], Path]:
    """A bucket holding the shard set under ``shards/``: its URL, storage options, and the
    local copy."""
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    name = f"shards-{uuid.uuid4().hex[:12]}"
    options: dict[str, object] = {"endpoint_url": s3_endpoint}
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    fs.mkdir(name)
    local = write_sequential_shards(tmp_path / "local", SHARDS)
    fs.put(str(local) + "/", f"{name}/shards/", recursive=True)
    return f"s3://{name}/shards/", options, local


def data_config(tokens: str, cache: Path, **extra: object) -> SpeedtronicConfig:
    data = {"tokens": tokens, "shard_cache": str(cache), "seed": 11, **extra}
    config = elastic_config(cache.parent / "run", data, micro=5, target=5, steps=1)
    return SpeedtronicConfig.from_dict({"model": config["model"], "data": config["data"]})


def first_ids(stream: BatchStream[object], batches: int) -> list[list[int]]:
    out = []
    for _ in range(batches):
        batch = next(stream)
        assert isinstance(batch, dict)
        out.append(batch["input_ids"][:, 0].tolist())
    return out


def fast(options: dict[str, object], cache: Path, **extra: object) -> RemoteShardOptions:
    values: dict[str, object] = {
        "storage_options": options,
        "cache": str(cache),
        "backoff_s": 0.01,
        **extra,
    }
    return RemoteShardOptions(**values)  # type: ignore[arg-type]  # the test's own keywords


def test_s3_shards_read_like_local_ones_within_a_bounded_cache_and_resume_exactly(
    bucket: tuple[str, dict[str, object], Path], tmp_path: Path
) -> None:
    url, options, local = bucket
    cache = tmp_path / "cache"
    remote_cfg = data_config(
        url, cache, storage_options=options, shard_cache_bytes=2 * SHARD_BYTES + 10
    )
    local_cfg = data_config(str(local), cache)
    expected = first_ids(BatchStream(build_dataloader(local_cfg.data, vocab_size=4096)), 160)
    stream = BatchStream(build_dataloader(remote_cfg.data, vocab_size=4096))
    got = first_ids(stream, 80)
    state = stream.state_dict()
    resumed = BatchStream(build_dataloader(remote_cfg.data, vocab_size=4096))
    resumed.load_state_dict(state)
    got += first_ids(resumed, 80)
    assert got == expected  # the same windows in the same order, resumed exactly
    entries = list(cache.glob("*.bin"))
    assert 1 <= len(entries) <= 2  # least recently used evicted: the bound holds
    manifest = read_manifest(local)
    assert {path.stem for path in entries} <= {shard.sha256 for shard in manifest.shards}
    # The prefetch thread may still be downloading the next shard into a part file: once
    # it settles, none is left behind (each is renamed into place or removed).
    assert no_part_files_left(cache)


def no_part_files_left(cache: Path, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while list(cache.glob(".*.part")):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_file_urls_are_read_through_the_cache_too(tmp_path: Path) -> None:
    local = write_sequential_shards(tmp_path / "local", SHARDS[:2])
    cache = tmp_path / "cache"
    remote = open_remote_token_dataset(f"file://{local}", fast({}, cache), block_size=BLOCK)
    plain = open_token_dataset(local, block_size=BLOCK)
    indices = np.arange(len(plain))
    assert torch.equal(remote.gather(indices)[0], plain.gather(indices)[0])
    assert len(list(cache.glob("*.bin"))) == 2


def test_prefetching_downloads_the_next_shards_of_the_order_in_the_background(
    bucket: tuple[str, dict[str, object], Path], tmp_path: Path
) -> None:
    url, options, _ = bucket
    cache = tmp_path / "cache"
    dataset = open_remote_token_dataset(url, fast(options, cache, prefetch=4), block_size=BLOCK)
    sampler = dataset.make_sampler(shuffle=True, seed=3)
    first = next(iter(sampler))  # computing the first block queues the shards it reads
    assert 0 <= first < len(dataset)
    deadline = time.monotonic() + 30
    while len(list(cache.glob("*.bin"))) < len(SHARDS) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(cache.glob("*.bin"))) == len(SHARDS)  # before any window was read


def test_a_damaged_shard_is_retried_then_one_error_names_it_and_nothing_is_cached(
    bucket: tuple[str, dict[str, object], Path], tmp_path: Path
) -> None:
    import s3fs

    url, options, local = bucket
    fs = s3fs.S3FileSystem(endpoint_url=options["endpoint_url"], skip_instance_cache=True)
    damaged = bytearray((local / "train-00001.bin").read_bytes())
    damaged[10] ^= 0xFF
    fs.pipe(url.removeprefix("s3://") + "train-00001.bin", bytes(damaged))
    cache = tmp_path / "cache"
    dataset = open_remote_token_dataset(
        url, fast(options, cache, prefetch=0, attempts=3), block_size=BLOCK
    )
    assert dataset.gather([0])[0][0, 0] == 0  # shard 0 is fine
    with pytest.raises(ShardError) as caught:
        dataset.gather([150])
    message = str(caught.value)
    assert f"{url.rstrip('/')}/train-00001.bin" in message and "sha256" in message
    assert "(3 tries)" in message
    assert len(list(cache.glob("*.bin"))) == 1 and not list(cache.glob(".*.part"))
    fs.rm(url.removeprefix("s3://") + "train-00002.bin")
    with pytest.raises(ShardError, match="train-00002.bin is missing"):
        dataset.gather([250])


def _download_from_fifo(source: str, fifo: str, cache: str) -> int:
    """Fetch shard 0 into the cache, its bytes coming from ``fifo`` (fed by the test)."""
    manifest = read_manifest(source)
    shard = manifest.shards[0]

    def download(out: BinaryIO) -> None:
        with open(fifo, "rb") as feed:
            while chunk := feed.read(64):
                out.write(chunk)
                out.flush()

    ShardCache(cache, 1 << 20).fetch(shard, SHARD_BYTES, manifest.numpy_dtype, download, "shard 0")
    return 0


def _fetch(source: str, cache: str) -> int:
    dataset = open_remote_token_dataset(
        f"file://{source}", fast({}, Path(cache), prefetch=0), block_size=BLOCK
    )
    dataset.gather([0])
    return 0


def test_a_killed_download_never_leaves_a_trusted_entry(tmp_path: Path, forked: Forked) -> None:
    local = write_sequential_shards(tmp_path / "local", SHARDS[:1])
    content = (local / "train-00000.bin").read_bytes()
    fifo = tmp_path / "feed"
    os.mkfifo(fifo)
    cache = tmp_path / "cache"
    child = forked.start(_download_from_fifo, str(local), str(fifo), str(cache))
    with open(fifo, "wb") as feed:  # half of the shard, then the download is killed
        feed.write(content[: len(content) // 2])
        feed.flush()
        deadline = time.monotonic() + 30
        while (
            not any(p.stat().st_size for p in cache.glob(".*.part")) and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        assert any(p.stat().st_size for p in cache.glob(".*.part")), child.output
        child.kill()
        child.wait(timeout=30)
    assert not list(cache.glob("*.bin"))  # the half-written part is not an entry
    dataset = open_remote_token_dataset(
        f"file://{local}", fast({}, cache, prefetch=0), block_size=BLOCK
    )
    assert dataset.gather([99])[0][0, 0] == 99 * BLOCK  # fetched afresh, verified
    assert len(list(cache.glob("*.bin"))) == 1 and not list(cache.glob(".*.part"))


def _fill_cache(source: str, cache: str, report: str) -> int:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (256, limit))
    dataset = open_remote_token_dataset(
        f"file://{source}", fast({}, Path(cache), prefetch=0), block_size=BLOCK
    )
    try:
        dataset.gather([0])
    except ShardCacheFull as exc:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # room for the report
        Path(report).write_text(json.dumps(str(exc)))
        return 2
    return 0


def test_a_cache_on_a_full_disk_is_one_clear_error(tmp_path: Path, forked: Forked) -> None:
    local = write_sequential_shards(tmp_path / "local", SHARDS[:1])
    cache, report = tmp_path / "cache", tmp_path / "report.json"
    child = forked.start(_fill_cache, str(local), str(cache), str(report))
    assert child.wait(timeout=60) == 2, child.output
    message = json.loads(report.read_text())
    assert message.startswith(f"data.shard_cache: {cache} has no room for data.tokens: file://")
    assert "free space there" in message
    assert not list(cache.glob("*.bin")) and not list(cache.glob(".*.part"))


def test_ranks_of_a_node_share_one_cache(tmp_path: Path, forked: Forked) -> None:
    local = write_sequential_shards(tmp_path / "local", SHARDS)
    cache = tmp_path / "cache"
    children = [forked.start(_fetch, str(local), str(cache)) for _ in range(3)]
    assert [child.wait(timeout=60) for child in children] == [0, 0, 0]
    assert len(list(cache.glob("*.bin"))) == 1  # one entry for shard 0, whoever fetched it


def test_a_cache_smaller_than_a_shard_is_refused(tmp_path: Path) -> None:
    local = write_sequential_shards(tmp_path / "local", SHARDS[:1])
    dataset = open_remote_token_dataset(
        f"file://{local}", fast({}, tmp_path / "cache", cache_bytes=100), block_size=BLOCK
    )
    with pytest.raises(ShardCacheFull, match="data.shard_cache_bytes: 100 bytes cannot hold"):
        dataset.gather([0])


def test_dataloader_workers_read_through_the_same_cache(tmp_path: Path) -> None:
    local = write_sequential_shards(tmp_path / "local", SHARDS[:2])
    cache = tmp_path / "cache"
    expected = first_ids(BatchStream(build_dataloader(data_config(str(local), cache).data)), 20)
    config = data_config(f"file://{local}", cache, num_workers=1)
    stream = BatchStream(build_dataloader(config.data))
    assert first_ids(stream, 20) == expected
    stream.abandon()
    assert len(list(cache.glob("*.bin"))) == 2


def test_the_cli_stops_on_a_damaged_shard_with_one_error_and_exit_2(
    tmp_path: Path, forked: Forked
) -> None:
    local = write_sequential_shards(tmp_path / "local", SHARDS[:2])
    damaged = bytearray((local / "train-00001.bin").read_bytes())
    damaged[5] ^= 1
    (local / "train-00001.bin").write_bytes(bytes(damaged))
    data = {
        "tokens": f"file://{local}",
        "shard_cache": str(tmp_path / "cache"),
        "shard_prefetch": 0,
    }
    config = elastic_config(tmp_path / "run", data, micro=4, target=4, steps=40)
    config["checkpoint"] = {"enabled": False}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    child = forked.start(cli_main, "fit", "--config", str(path))
    assert child.wait(timeout=120) == 2, child.output
    errors = [line for line in child.output.splitlines() if line.startswith("speedtronic: error:")]
    assert len(errors) == 1 and "Traceback" not in child.output
    assert f"file://{local}/train-00001.bin: the downloaded bytes have sha256" in errors[0]
    assert errors[0].endswith("(4 tries)")
    damaged_sha = read_manifest(local).shards[1].sha256
    assert not (tmp_path / "cache" / f"{damaged_sha}.bin").exists()
    assert not list((tmp_path / "cache").glob(".*.part"))
