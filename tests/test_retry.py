"""The one retry policy (``speedtronic.util.retry``): the schedule, what is retried, what is
raised when the tries run out, and a wait that stops early. No real sleeping: ``sleep`` is
recorded."""

from __future__ import annotations

import random
from typing import NoReturn

import pytest

from speedtronic.util.retry import Backoff, retry


class Flaky:
    """Fails with ``errors`` in turn, then returns ``"ok"``."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


@pytest.mark.parametrize(("jitter", "low"), [("full", 0.0), ("equal", 0.5)], ids=["full", "equal"])
def test_the_wait_doubles_up_to_the_cap_within_its_jitter(jitter: str, low: float) -> None:
    backoff = Backoff(attempts=6, initial_s=1.0, max_s=4.0, jitter=jitter)  # type: ignore[arg-type]  # parametrized Literal
    sleeps: list[float] = []
    operation = Flaky(*[OSError("blip")] * 5)
    assert retry(backoff, operation, retry_if=lambda _: True, sleep=sleeps.append) == "ok"
    assert operation.calls == 6
    for seconds, cap in zip(sleeps, [1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert low * cap <= seconds <= cap
    assert backoff.delay(3, 0.0) == low * 4.0 and backoff.delay(3, 1.0) == 4.0
    assert backoff.delay(5000, 1.0) == 4.0  # a long schedule caps, never overflows


def test_an_error_that_is_not_retried_is_raised_at_once() -> None:
    operation = Flaky(ValueError("bad"), OSError("blip"))
    sleeps: list[float] = []
    with pytest.raises(ValueError, match="bad"):
        retry(
            Backoff(3, 1.0, 2.0),
            operation,
            retry_if=lambda error: isinstance(error, OSError),
            sleep=sleeps.append,
        )
    assert operation.calls == 1 and sleeps == []


def test_running_out_raises_the_last_error_or_what_give_up_raises() -> None:
    with pytest.raises(OSError, match="third"):
        retry(
            Backoff(3, 0.1, 0.1),
            Flaky(OSError("first"), OSError("second"), OSError("third")),
            retry_if=lambda _: True,
            sleep=lambda _: None,
        )

    def give_up(last: BaseException) -> NoReturn:
        raise RuntimeError(f"gave up: {last}") from last

    retried: list[tuple[str, float]] = []
    with pytest.raises(RuntimeError, match="gave up: second") as caught:
        retry(
            Backoff(2, 0.1, 0.1, jitter="equal"),
            Flaky(OSError("first"), OSError("second")),
            retry_if=lambda _: True,
            on_retry=lambda error, seconds: retried.append((str(error), seconds)),
            give_up=give_up,
            sleep=lambda _: None,
            rng=random.Random(0),
        )
    assert isinstance(caught.value.__cause__, OSError)
    assert [error for error, _ in retried] == ["first"]
    assert 0.05 <= retried[0][1] <= 0.1


def test_a_wait_that_raises_stops_the_retries() -> None:
    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    operation = Flaky(OSError("blip"), OSError("blip"))
    with pytest.raises(KeyboardInterrupt):
        retry(Backoff(5, 1.0, 1.0), operation, retry_if=lambda _: True, sleep=interrupted)
    assert operation.calls == 1
