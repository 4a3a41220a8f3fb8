"""Synthetic token data: uniform noise, and a learnable Markov language with a known floor.

Both are map-style and deterministic per index (item ``i`` comes from a generator seeded
with ``seed + i``), so the content of a sample does not depend on the order or the process
that reads it: shuffling, worker processes and resumed runs all see the same samples.

``held_out=True`` gives the held-out set of the same source: the same language (the Markov
table depends on ``seed`` only) but items drawn from another stream -- item ``i``'s generator
is seeded from a ``SeedSequence`` of ``(seed, i, _HELD_OUT_STREAM)``, never ``seed + j`` for
any ``j`` -- so no training sequence is evaluated on.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from bisect import bisect_right
from functools import cached_property

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

__all__ = ["LearnableLanguageDataset", "SyntheticTokenDataset"]

_UINT64 = (1 << 64) - 1
_TABLE_STREAM = 0x7AB1E
"""Mixed into the seed of the transition table so it is independent of every item's stream."""
_HELD_OUT_STREAM = 0xE7A1
"""Mixed into the seed of every held-out item, so held-out items never repeat training ones."""


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _item_generator(seed: int, index: int, held_out: bool = False) -> torch.Generator:
    if held_out:
        sequence = np.random.SeedSequence([seed & _UINT64, index, _HELD_OUT_STREAM])
        return torch.Generator().manual_seed(int(sequence.generate_state(1, np.uint64)[0]))
    # torch accepts any value in [-2**63, 2**64); masking keeps huge seeds + index valid.
    return torch.Generator().manual_seed((seed + index) & _UINT64)


class _IndexedTokens(Dataset[dict[str, torch.Tensor]], ABC):
    """Shared map-style plumbing: length, index normalisation, the input/label split."""

    def __init__(
        self, num_samples: int, block_size: int, vocab_size: int, seed: int, held_out: bool
    ) -> None:
        self.held_out = held_out
        self.num_samples = _check_positive("num_samples", num_samples)
        self.block_size = _check_positive("block_size", block_size)
        self.vocab_size = _check_positive("vocab_size", vocab_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        position = index + self.num_samples if index < 0 else index
        if not 0 <= position < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        tokens = self._tokens(position)
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}

    @abstractmethod
    def _tokens(self, index: int) -> torch.Tensor:
        """``block_size + 1`` int64 token ids of sample ``index``."""


class SyntheticTokenDataset(_IndexedTokens):
    """Uniform random tokens: nothing to learn, the loss floor is ``ln(vocab_size)``."""

    def __init__(
        self,
        num_samples: int = 10000,
        block_size: int = 128,
        vocab_size: int = 512,
        seed: int = 1234,
        *,
        held_out: bool = False,
    ) -> None:
        super().__init__(num_samples, block_size, vocab_size, seed, held_out)

    @property
    def entropy_floor(self) -> float:
        """The lowest achievable expected loss, in nats per token."""
        return math.log(self.vocab_size)

    def _tokens(self, index: int) -> torch.Tensor:
        generator = _item_generator(self.seed, index, self.held_out)
        return torch.randint(
            0, self.vocab_size, (self.block_size + 1,), generator=generator, dtype=torch.int64
        )


class LearnableLanguageDataset(_IndexedTokens):
    """A random sparse first-order Markov chain over the vocabulary.

    Once per dataset (from ``seed``) every state gets ``branching`` distinct successors
    with probabilities drawn from a symmetric Dirichlet(``concentration``). A sample starts
    in a uniformly random state and walks the chain for ``block_size`` steps.

    ``entropy_floor`` is the exact expected loss of the Bayes-optimal predictor on this
    dataset, in nats per token: the next token depends only on the current one, so the best
    possible prediction at every position is the current state's successor distribution,
    and the floor is the mean over the ``block_size`` label positions of
    ``sum_s P(x_t = s) * H(successors of s)``, with ``P(x_t)`` propagated exactly from the
    uniform start (a per-position expectation; no stationarity is assumed). A model whose
    loss approaches it has learned the chain.

    ``branching`` defaults to ``min(4, vocab_size)``; the default Dirichlet(1) gives a
    floor near 1.08 nats for 4 successors, far below the ``ln(vocab_size)`` of guessing.
    """

    def __init__(
        self,
        num_samples: int = 10000,
        block_size: int = 128,
        vocab_size: int = 512,
        seed: int = 1234,
        *,
        branching: int | None = None,
        concentration: float = 1.0,
        held_out: bool = False,
    ) -> None:
        super().__init__(num_samples, block_size, vocab_size, seed, held_out)
        width = min(4, vocab_size) if branching is None else _check_positive("branching", branching)
        if width > vocab_size:
            raise ValueError(f"branching ({width}) cannot exceed vocab_size ({vocab_size})")
        if isinstance(concentration, bool) or not (
            isinstance(concentration, (int, float)) and math.isfinite(concentration)
        ):
            raise ValueError(f"concentration must be a positive number, got {concentration!r}")
        if concentration <= 0:
            raise ValueError(f"concentration must be a positive number, got {concentration!r}")
        self.branching = width
        self.concentration = float(concentration)
        successors, probabilities = self._draw_table()
        successors.flags.writeable = False
        probabilities.flags.writeable = False
        self.successors: npt.NDArray[np.int64] = successors
        """``(vocab_size, branching)`` successor token ids of every state."""
        self.successor_probs: npt.NDArray[np.float64] = probabilities
        """``(vocab_size, branching)`` probability of each successor (rows sum to 1)."""
        # Plain Python lists: a per-token bisect on a list beats NumPy calls on tiny arrays.
        self._successor_rows: list[list[int]] = successors.tolist()
        self._cumulative_rows: list[list[float]] = [
            [*row[:-1], 1.0] for row in np.cumsum(probabilities, axis=1).tolist()
        ]

    def _draw_table(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        entropy = [self.seed & _UINT64, _TABLE_STREAM]
        rng = np.random.default_rng(np.random.SeedSequence(entropy))
        vocab, width = self.vocab_size, self.branching
        successors = np.empty((vocab, width), dtype=np.int64)
        for state in range(vocab):
            successors[state] = rng.choice(vocab, size=width, replace=False)
        probabilities = rng.dirichlet(np.full(width, self.concentration), size=vocab)
        return successors, probabilities.astype(np.float64)

    @cached_property
    def state_entropy(self) -> npt.NDArray[np.float64]:
        """Entropy (nats) of each state's successor distribution."""
        probs = self.successor_probs
        logs = np.log(np.where(probs > 0, probs, 1.0))
        result: npt.NDArray[np.float64] = -(probs * logs).sum(axis=1)
        return result

    @cached_property
    def position_entropy(self) -> npt.NDArray[np.float64]:
        """Expected optimal loss at each of the ``block_size`` label positions (nats)."""
        vocab = self.vocab_size
        occupancy = np.full(vocab, 1.0 / vocab)
        flat_successors = self.successors.ravel()
        floors = np.empty(self.block_size, dtype=np.float64)
        for position in range(self.block_size):
            floors[position] = float(occupancy @ self.state_entropy)
            flow = (occupancy[:, None] * self.successor_probs).ravel()
            occupancy = np.bincount(flat_successors, weights=flow, minlength=vocab)
        return floors

    @cached_property
    def entropy_floor(self) -> float:
        """The lowest achievable expected loss on this dataset, in nats per token."""
        return float(self.position_entropy.mean())

    def _tokens(self, index: int) -> torch.Tensor:
        uniforms = torch.rand(
            self.block_size + 1,
            generator=_item_generator(self.seed, index, self.held_out),
            dtype=torch.float64,
        ).tolist()
        state = min(int(uniforms[0] * self.vocab_size), self.vocab_size - 1)
        tokens = [state]
        successors, cumulative = self._successor_rows, self._cumulative_rows
        for draw in uniforms[1:]:
            state = successors[state][bisect_right(cumulative[state], draw)]
            tokens.append(state)
        return torch.tensor(tokens, dtype=torch.int64)
