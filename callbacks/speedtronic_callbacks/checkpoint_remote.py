"""The checkpoint plugin's object-store side: credentials kept out of the config, the
upload mirror's start (the claim of the prefix), the bounded final wait, and the fetch on
resume shared by the ranks.

What the store does is ``speedtronic.state.remote`` (the mirror), ``remote_owner`` (the
ownership record), ``remote_fetch`` (the download) and ``remote_store`` (file operations);
this module is how the ``checkpoint`` callback (``speedtronic_callbacks.checkpoint``) uses
them during a fit.
"""

from __future__ import annotations

import logging
import signal
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.remote import RemoteMirror
from speedtronic.state.remote_fetch import fetch_newer
from speedtronic.state.remote_store import RemoteStore, RetryPolicy
from speedtronic.state.resume import FetchedCheckpoint

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = [
    "credential_errors",
    "fetch",
    "start_mirror",
    "url_credential_errors",
    "wait_for_uploads",
]

logger = logging.getLogger("speedtronic.checkpoint")

_CLAIM_WAIT_S = 5.0
"""How long the start of a fit waits for the claim of its remote prefix (then it trains on
while the claim completes; a refusal stops it at the next step)."""
_TELL_AFTER_S = 3.0
"""The final wait for uploads says what it waits for once it lasted this long."""
_POLL_S = 0.25
"""The final wait checks for a signal this often."""


def start_mirror(
    store: RemoteStore,
    manager: CheckpointManager,
    *,
    retry: RetryPolicy,
    run_id: str | None,
    output_dir: Path,
    take_over: bool,
    wait_s: float,
) -> RemoteMirror:
    """Rank 0's uploader for this fit, its claim of the prefix started on the upload
    thread: a store that answers within ``_CLAIM_WAIT_S`` (at most ``wait_s``) refuses
    another run's prefix here (``RemoteOwnerError``), before the first step; a slower one
    at the next step after it answers (``RemoteMirror.refusal``)."""
    mirror = RemoteMirror(
        store,
        manager,
        retry=retry,
        run_id=run_id,
        output_dir=str(output_dir),
        take_over=take_over,
    )
    mirror.start()
    mirror.flush(timeout=min(_CLAIM_WAIT_S, wait_s))
    if mirror.refusal is not None:
        mirror.close(0.0)
        raise mirror.refusal
    return mirror


def wait_for_uploads(
    mirror: RemoteMirror,
    *,
    seconds: float,
    directory: Path,
    newest: str | None,
    interrupted: Callable[[], signal.Signals | None],
) -> bool:
    """Wait until every upload submitted to ``mirror`` is done, at most ``seconds``;
    after ``_TELL_AFTER_S`` say what it waits for, and stop at once when ``interrupted()``
    names a signal. ``True`` when the uploads finished (a warning when ``newest``, the
    fit's last checkpoint, is not in the store); ``False`` when the wait ended early (a
    warning naming the checkpoint that stays only in ``directory``). Raises the mirror's
    ``refusal`` (the prefix is another run's)."""
    started = time.monotonic()
    deadline = started + seconds
    told = False
    while not (finished := mirror.flush(_poll(deadline))):
        now = time.monotonic()
        if interrupted() is not None or now >= deadline:
            break
        if not told and now - started >= _TELL_AFTER_S:
            told = True
            logger.warning(
                "checkpoint.remote: waiting up to %s more (checkpoint.remote_final_wait_s) "
                "for %s to reach %s; now: %s. It is in %s either way",
                _seconds(deadline - now),
                mirror.submitted or "the last upload",
                mirror.store.url,
                mirror.activity or "between operations",
                directory,
            )
    if mirror.refusal is not None:
        raise mirror.refusal
    there = f"the newest there is {mirror.verified}" if mirror.verified else None
    if not finished:
        received = interrupted()
        why = (
            f"{received.name} received"
            if received is not None
            else f"checkpoint.remote_final_wait_s {seconds:g} s passed"
        )
        logger.warning(
            "checkpoint.remote: stopped waiting for the upload (%s; %s): %s is not in %s (%s); "
            "it is in %s",
            mirror.activity or "uploading",
            why,
            newest,
            mirror.store.url,
            there or "none yet",
            directory,
        )
    elif newest is not None and mirror.verified != newest:
        logger.warning(
            "checkpoint.remote: the newest checkpoint %s is not in %s (%s); it is in %s",
            newest,
            mirror.store.url,
            there or "no upload of this fit succeeded",
            directory,
        )
    return finished


def _poll(deadline: float) -> float:
    """How long the next wait for the mirror lasts: a poll interval, or what is left."""
    return min(_POLL_S, max(0.0, deadline - time.monotonic()))


def _seconds(value: float) -> str:
    """``9m 58s``, ``42s``: a wait's length for a message."""
    whole = max(0, round(value))
    return f"{whole // 60}m {whole % 60:02d}s" if whole >= 60 else f"{whole}s"


def fetch(
    store: RemoteStore,
    manager: CheckpointManager,
    trainer: TrainerView,
    *,
    retry: RetryPolicy,
    run_id: str | None,
    allow_other_run: bool,
) -> FetchedCheckpoint:
    """``fetch_newer`` by one process per node; every rank gets rank 0's verdict (the
    checkpoint's path, the prefix's owner) once every node's download is done."""
    distributed = trainer.distributed
    path: Path | None = None
    owner: str | None = None
    if distributed is None or distributed.is_local_main:
        fetched = fetch_newer(
            store, manager, retry=retry, run_id=run_id, allow_other_run=allow_other_run
        )
        path, owner = fetched.path, fetched.owner
    if distributed is not None and distributed.world_size > 1:
        import torch.distributed as dist

        # Every node's download is done before any rank loads (a broadcast alone would
        # release another node's ranks while their local main still downloads).
        distributed.barrier()
        verdict: list[object] = [None if path is None else path.name, owner]
        dist.broadcast_object_list(verdict, src=0)  # rank 0's verdict, for every rank
        name, chosen = verdict
        path = None if name is None else manager.directory / str(name)
        owner = None if chosen is None else str(chosen)
    return FetchedCheckpoint(path, owner)


_CREDENTIAL_KEYS = frozenset(
    {"key", "secret", "token", "password", "session_token", "access_key", "secret_key"}
    | {"aws_access_key_id", "aws_secret_access_key", "aws_session_token", "account_key"}
    | {"sas_token", "client_secret", "api_key", "hmac_key"}
)
"""Storage-option keys that hold credentials: refused in ``remote_options`` (the config is
saved with the run and inside every checkpoint); they come from the environment."""


_NO_CREDENTIALS = (
    "credentials do not belong in the config (it is saved with the run and in every "
    "checkpoint); set them in the environment instead (AWS_ACCESS_KEY_ID, "
    "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE)"
)


def url_credential_errors(path: str, url: object) -> Iterator[str]:
    """A ``user:password@`` in the remote URL is a credential in the config too (fsspec
    passes it on to the store, and the URL is saved with the run like the options)."""
    if not isinstance(url, str):
        return
    for part in url.split("::"):  # fsspec chains: 'simplecache::s3://...'
        try:
            password = urllib.parse.urlsplit(part).password
        except ValueError:  # a malformed URL is the store's to refuse, with its own words
            continue
        if password is not None:
            yield f"{path}: the URL holds a password (user:password@host); {_NO_CREDENTIALS}"
            return


def credential_errors(path: str, options: object, depth: int = 0) -> Iterator[str]:
    if not isinstance(options, Mapping) or depth > 8:
        return
    for key, value in options.items():
        if isinstance(key, str) and key.lower() in _CREDENTIAL_KEYS:
            yield f"{path}.{key}: {_NO_CREDENTIALS}"
        elif isinstance(value, str):  # endpoint_url and any other URL-valued option
            yield from url_credential_errors(f"{path}.{key}", value)
        else:
            yield from credential_errors(f"{path}.{key}", value, depth + 1)
