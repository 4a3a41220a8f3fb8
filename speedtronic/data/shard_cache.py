"""A bounded local cache of token shards downloaded from object storage.

Entries are named by content, ``<sha256>.bin`` (the manifest's hash of the shard), so two
URLs of the same shard share one entry. An entry appears only whole and verified: a shard is
downloaded into a hidden part file (``.<sha256>.<pid>.<random>.part``), its sha256 and
largest token id are checked against the manifest, and only then is it renamed into place.
A download that dies half way (killed, a lost connection, a full disk) leaves at most a part
file, which is never read and is removed by the next download of that shard. Anything else
that is not a regular file of the recorded size under an entry's name is not trusted.

Several processes on one node (the ranks, their DataLoader workers) share one cache
directory: a shard is downloaded under an exclusive lock on ``<sha256>.lock``
(``filelock``), so the others wait and then find the entry; making room takes a lock on
the whole cache (``cache.lock``). Eviction is least recently used: a lookup touches the
entry's modification time, and before a download the oldest entries are removed until the
new shard fits under ``max_bytes``. A process that has an evicted shard mapped keeps reading
it (the file is unlinked, not overwritten); the space comes back when it unmaps it, so the
disk in use can pass ``max_bytes`` by what the readers still have mapped.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
from filelock import FileLock

from speedtronic.data.shards import ShardEntry, ShardError, shard_digest

__all__ = ["ShardCache", "ShardCacheFull", "default_cache_directory"]

_LOCK_TIMEOUT_S = 3600.0
"""How long a process waits for another one's download of the same shard."""
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class ShardCacheFull(ShardError):
    """The cache directory has no room for a shard (a full disk, a quota, a file-size limit)."""


class _ShardDamaged(ShardError):
    """A downloaded shard whose bytes are not those the manifest records."""


def default_cache_directory() -> Path:
    """``$XDG_CACHE_HOME/speedtronic/shards`` (``~/.cache/speedtronic/shards``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "speedtronic" / "shards"


class ShardCache:
    """Verified shards in ``directory``, at most ``max_bytes`` of them (module docstring)."""

    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ShardError(
                f"data.shard_cache: cannot use {self.directory} as the shard cache "
                f"({exc.strerror or exc}): name a writable directory"
            ) from None

    def entry(self, shard: ShardEntry) -> Path:
        return self.directory / f"{shard.sha256}.bin"

    def lookup(self, shard: ShardEntry, size: int) -> Path | None:
        """The cached shard (touched: it is now the most recently used), or None."""
        path = self.entry(shard)
        try:
            info = path.lstat()
        except FileNotFoundError:
            return None
        if not path.is_file() or path.is_symlink() or info.st_size != size:
            return None  # not an entry this cache wrote: fetched again (and replaced)
        try:
            os.utime(path)
        except FileNotFoundError:  # evicted this instant by another process
            return None
        return path

    def fetch(
        self,
        shard: ShardEntry,
        size: int,
        dtype: np.dtype[np.unsignedinteger],
        download: Callable[[BinaryIO], None],
        where: str,
    ) -> Path:
        """The cached shard, downloaded by ``download(out)`` when it is not there yet:
        verified against ``shard`` (``_ShardDamaged``), renamed into place. ``where`` names
        the shard in errors."""
        found = self.lookup(shard, size)
        if found is not None:
            return found
        with FileLock(str(self.directory / f"{shard.sha256}.lock"), timeout=_LOCK_TIMEOUT_S):
            found = self.lookup(shard, size)
            if found is not None:
                return found  # another process downloaded it while this one waited
            for stale in self.directory.glob(f".{shard.sha256}.*.part"):
                stale.unlink(missing_ok=True)  # a dead download's (this lock is held)
            self._make_room(size, where)
            part = self.directory / f".{shard.sha256}.{os.getpid()}.{secrets.token_hex(4)}.part"
            try:
                self._download(part, download, size, where)
                digest, largest = shard_digest(part, dtype)
                if digest != shard.sha256 or (shard.max_id is not None and largest != shard.max_id):
                    raise _ShardDamaged(
                        f"{where}: the downloaded bytes have sha256 {digest[:16]}..., the "
                        f"manifest records {shard.sha256[:16]}...: the stored shard is damaged "
                        "or was replaced; prepare and upload the shards again"
                    )
                os.replace(part, self.entry(shard))
            finally:
                part.unlink(missing_ok=True)
            self._make_room(0, where)  # downloads of other shards ran beside this one
        return self.entry(shard)

    def _download(
        self, part: Path, download: Callable[[BinaryIO], None], size: int, where: str
    ) -> None:
        try:
            with open(part, "xb") as out:
                download(out)
                written = out.tell()
        except OSError as exc:
            if exc.errno in _FULL:
                raise ShardCacheFull(
                    f"data.shard_cache: {self.directory} has no room for {where} ({size:,} "
                    f"bytes): {exc.strerror}; free space there, point data.shard_cache at a "
                    "larger disk, or lower data.shard_cache_bytes"
                ) from None
            raise
        if written != size:
            raise _ShardDamaged(
                f"{where}: {written:,} bytes downloaded, the manifest records {size:,}: the "
                "stored shard is truncated or was replaced; prepare and upload the shards again"
            )

    def _make_room(self, size: int, where: str) -> None:
        """Evict the least recently used entries until ``size`` more bytes fit."""
        if size > self.max_bytes:
            raise ShardCacheFull(
                f"data.shard_cache_bytes: {self.max_bytes:,} bytes cannot hold {where} "
                f"({size:,} bytes): raise it to a few shards at least"
            )
        with FileLock(str(self.directory / "cache.lock"), timeout=_LOCK_TIMEOUT_S):
            entries = []
            for path in self.directory.glob("*.bin"):
                try:
                    info = path.lstat()
                except FileNotFoundError:
                    continue
                entries.append((info.st_mtime_ns, info.st_size, path))
            used = sum(entry[1] for entry in entries)
            for _, bytes_, path in sorted(entries):
                if used + size <= self.max_bytes:
                    break
                path.unlink(missing_ok=True)
                used -= bytes_

    def cached_bytes(self) -> int:
        """What the entries hold now."""
        return sum(path.stat().st_size for path in self.directory.glob("*.bin"))
