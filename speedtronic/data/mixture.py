"""Several token-shard sources mixed by weight (``data.mixture``).

An epoch of the mixture has as many samples as all its sources have windows together
(``N = n_1 + ... + n_S``), and source ``s`` contributes exactly ``N_s`` of them: ``N * w_s``
for the normalised weight ``w_s``, rounded by largest remainder so the quotas sum to ``N``.
The proportions hold exactly per epoch, and within one sample per source in every round of
it: the ``N`` positions of epoch ``e`` are cut into ``K`` rounds of about ``_MIX_ROUND``
positions (more rounds where a source's share of one would pass half its working set), round
``g`` holds source ``s``'s draws ``floor(g N_s / K) .. floor((g + 1) N_s / K) - 1`` of the
epoch, and its positions are dealt to them by a seeded permutation of the round
(``Permutation``, keyed by ``(data.seed, e, g)``), so a batch is a random draw from the sources.

Each source is read as an endless sequence of passes, each a fresh order of its windows (the
source's own ``ChunkedPermutation``, keyed by the source's position in the list and the pass
number): draw ``k`` of source ``s`` is window ``perm_{s, k // n_s}(k % n_s)``, and epoch ``e``
of the mixture takes draws ``e * N_s .. (e + 1) * N_s - 1``, in that order round by round. So
a source that runs out -- a quota larger than its windows: a small source with a large
weight -- starts its next pass, in a new order, within the same mixture epoch; a source with
a smaller quota than windows continues in the next mixture epoch where it stopped. Either way
the ``p``-th ``n_s`` draws of a source are one whole pass over it: every window once. And since
a round takes consecutive draws of each source, each source's reads stay as local as its own
order makes them (module ``windows``, "Order").

Everything is a pure function of ``(seed, epoch, position)``: the sampler (a
``WindowSampler``) yields draw keys, ranks take strided positions, and a resumed run continues
at the exact position, as for a single source. The mixture is always shuffled.

Its held-out set (``eval:``) is every source's held-out windows, interleaved in proportion to
their counts in a fixed, seeded order (``speedtronic.data.interleave``), so a bounded evaluation
(``eval.max_batches``) sees every source.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

from speedtronic.data.interleave import Interleave
from speedtronic.data.stream import _epoch_seed
from speedtronic.data.text import DataSourceError, TextPart
from speedtronic.data.window_order import (
    ChunkedPermutation,
    Permutation,
    WindowSampler,
    _distinct,
)
from speedtronic.data.windows import (
    TokenWindowDataset,
    WindowSource,
    open_token_dataset,
    source_manifest,
)

__all__ = ["MixtureDataset", "MixtureSampler", "apportion", "open_mixture"]

_MIX_ROUND = 4096
"""Positions of a round of the mixture's deal (about; each round holds every source's share)."""

_MIX_STREAM = 0x6D1C_7E00
_SOURCE_STREAM = 0x5A0C_E500
_KEY_LIMIT = 1 << 62


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` by largest remainder (ties to the
    earlier source): whole numbers that sum to ``total``."""
    weight_sum = sum(weights)
    exact = [total * weight / weight_sum for weight in weights]
    quotas = [int(value) for value in exact]
    left = total - sum(quotas)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for index in by_remainder[:left]:
        quotas[index] += 1
    return quotas


class MixtureDataset(WindowSource):
    """The sources' windows addressed by draw keys ``k * S + s`` (draw ``k`` of source
    ``s``, module docstring); ``len`` is the epoch length ``N``. Its ``make_sampler`` yields the
    keys; use it (the keys are not the positions ``0 .. N - 1``)."""

    default_shuffle = True

    def __init__(
        self, sources: Sequence[TokenWindowDataset], weights: Sequence[float], *, seed: int
    ) -> None:
        if not sources or len(sources) != len(weights):
            raise ValueError("a mixture needs one weight per source, and at least one source")
        if any(not weight > 0 for weight in weights):
            raise ValueError(f"mixture weights must be positive, got {list(weights)}")
        self.sources = list(sources)
        self.document_eos = sources[0].document_eos  # one tokenizer (open_mixture checks)
        self.weights = [float(weight) for weight in weights]
        self.seed = seed
        self.sizes = np.array([len(source) for source in self.sources], dtype=np.int64)
        self.length = int(self.sizes.sum())
        self.quotas = np.array(apportion(self.length, self.weights), dtype=np.int64)
        self.quota_starts = np.concatenate([[0], np.cumsum(self.quotas)]).astype(np.int64)
        self._orders: dict[tuple[int, int], ChunkedPermutation] = {}

    def __len__(self) -> int:
        return self.length

    def decode(
        self, keys: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(source, window)`` of each draw key."""
        count = len(self.sources)
        sources = keys % count
        draws = keys // count
        sizes = self.sizes[sources]
        passes = draws // sizes
        within = draws % sizes
        windows = np.empty_like(within)
        for source in _distinct(sources):
            of_source = sources == source
            for pass_ in _distinct(passes[of_source]):
                chosen = of_source & (passes == pass_)
                windows[chosen] = self._pass_order(source, pass_)(within[chosen])
        return sources, windows

    def _pass_order(self, source: int, pass_: int) -> ChunkedPermutation:
        """The order of pass ``pass_`` over source ``source`` (a few kept: consecutive
        batches ask for the same ones)."""
        found = self._orders.get((source, pass_))
        if found is None:
            if len(self._orders) >= 4 * len(self.sources):
                self._orders.clear()
            key = _epoch_seed(_epoch_seed(self.seed, source) ^ _SOURCE_STREAM, pass_)
            of = self.sources[source]
            found = ChunkedPermutation(
                int(self.sizes[source]), key, chunk=of.chunk_windows, group=of.group_chunks
            )
            self._orders[(source, pass_)] = found
        return found

    def gather(
        self, keys: Sequence[int] | npt.NDArray[np.int64]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        wanted = np.asarray(keys, dtype=np.int64)
        if wanted.size and wanted.min() < 0:
            raise IndexError("mixture draw keys are non-negative")
        sources, windows = self.decode(wanted)
        size = self.sources[0].block_size
        inputs = torch.empty((wanted.size, size), dtype=torch.int64)
        labels = torch.empty((wanted.size, size), dtype=torch.int64)
        for source in _distinct(sources):
            rows = np.flatnonzero(sources == source)
            part_inputs, part_labels = self.sources[source].gather(windows[rows])
            index = torch.from_numpy(rows)
            inputs[index] = part_inputs
            labels[index] = part_labels
        return inputs, labels

    def make_sampler(
        self, *, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1
    ) -> MixtureSampler:
        del shuffle  # a mixture is always shuffled (module docstring)
        return MixtureSampler(self, seed=seed, rank=rank, world_size=world_size)


class MixtureSampler(WindowSampler):
    """The mixture's order: position ``p`` of epoch ``e`` -> its round ``g`` and slot in it (a
    permutation of the round keyed by ``(seed, e, g)``) -> a source's draw ``j`` of the epoch
    -> draw key ``(e * N_s + j) * S + s`` (module docstring)."""

    def __init__(self, mixture: MixtureDataset, *, seed: int, rank: int, world_size: int) -> None:
        super().__init__(len(mixture), shuffle=True, seed=seed, rank=rank, world_size=world_size)
        self.mixture = mixture
        # K rounds: about _MIX_ROUND positions, fewer where a source's share of a round would
        # exceed half its working set (its reads would then spread over several). Quota N_s =
        # whole_s * K + rest_s, so floor(g N_s / K) needs no product beyond rest_s * g < K * K
        # (int64 for any K below 2^31).
        rounds = len(mixture) // _MIX_ROUND
        for source, quota in zip(mixture.sources, mixture.quotas.tolist(), strict=True):
            if source.chunk_windows > 1:
                working_set = source.chunk_windows * source.group_chunks
                rounds = max(rounds, -(-2 * quota // working_set))
        self.rounds = max(1, min(rounds, 1 << 31))
        whole, rest = np.divmod(mixture.quotas, self.rounds)
        self._whole, self._rest = whole.astype(np.int64), rest.astype(np.int64)
        self._deals: dict[tuple[int, int], Permutation] = {}

    @property
    def order_version(self) -> int:
        """2: the mixture is dealt in rounds over locality-aware sources."""
        return 2

    def _before(self, rounds: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``[len(rounds), S]``: each source's draws of the epoch before each round."""
        column = rounds[:, None]
        shares: npt.NDArray[np.int64] = column * self._whole + column * self._rest // self.rounds
        return shares

    def _round_of(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The round of each position: the ``g`` with ``start(g) <= p < start(g + 1)``, where
        ``start(g)`` (the draws of all sources before round ``g``) is within ``S`` of
        ``g N / K``; found from that estimate."""
        estimate = positions.astype(np.float64) * (self.rounds / max(1, self.dataset_len))
        rounds = np.clip(estimate.astype(np.int64), 0, self.rounds - 1)
        while True:
            early = self._before(rounds).sum(axis=1) > positions
            late = self._before(rounds + 1).sum(axis=1) <= positions
            if not (early.any() or late.any()):
                return rounds
            rounds = rounds - early + late

    def _deal(self, round_: int, size: int, epoch: int | None = None) -> Permutation:
        """The permutation of round ``round_`` of this epoch (or of ``epoch``; a few kept)."""
        epoch = self.epoch if epoch is None else epoch
        found = self._deals.get((epoch, round_))
        if found is None:
            if len(self._deals) >= 4:
                del self._deals[next(iter(self._deals))]  # the earliest made
            key = _epoch_seed(_epoch_seed(self.seed ^ _MIX_STREAM, epoch), round_)
            found = Permutation(size, key)
            self._deals[(epoch, round_)] = found
        return found

    def drawn_in_epoch(self, epoch: int, position: int) -> npt.NDArray[np.int64]:
        """How many of the positions ``0 .. position - 1`` of epoch ``epoch`` (all ranks
        together) each source fills: its draws of the rounds before, and in the round
        ``position`` falls in, the slots of the round's deal dealt to it so far. For metrics
        (``speedtronic.engine.mixture_metrics``): a round's deal at most, never per step."""
        quotas = self.mixture.quotas
        if position >= len(self.mixture):
            return quotas.copy()
        if position <= 0:
            return np.zeros_like(quotas)
        round_ = int(self._round_of(np.array([position], dtype=np.int64))[0])
        low, high = self._before(np.array([round_, round_ + 1], dtype=np.int64))
        starts = np.concatenate([[0], np.cumsum(high - low)]).astype(np.int64)
        done = position - int(low.sum())
        slots = self._deal(round_, int(starts[-1]), epoch)(np.arange(done, dtype=np.int64))
        sources = np.searchsorted(starts, slots, side="right") - 1
        counts: npt.NDArray[np.int64] = low + np.bincount(sources, minlength=len(quotas))
        return counts

    def _indices(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        mixture = self.mixture
        count = len(mixture.sources)
        if (self.epoch + 1) * int(mixture.quotas.max()) * count >= _KEY_LIMIT:
            raise ValueError(f"epoch {self.epoch} is past what the mixture's keys can address")
        rounds = self._round_of(positions)
        keys = np.empty_like(positions)
        for round_ in _distinct(rounds):
            chosen = rounds == round_
            low, high = self._before(np.array([round_, round_ + 1], dtype=np.int64))
            starts = np.concatenate([[0], np.cumsum(high - low)]).astype(np.int64)
            slots = self._deal(round_, int(starts[-1]))(positions[chosen] - int(low.sum()))
            sources = np.searchsorted(starts, slots, side="right") - 1
            draws = self.epoch * mixture.quotas[sources] + low[sources] + slots - starts[sources]
            keys[chosen] = draws * count + sources
        return keys


def open_mixture(
    entries: Sequence[tuple[str, float]],
    *,
    block_size: int,
    seed: int,
    part: TextPart = "all",
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    verify: bool = True,
    document_mask: bool = False,
) -> Dataset[dict[str, torch.Tensor]]:
    """The mixture of ``entries`` (``(directory, weight)``) for training, or for ``part``
    ``"held_out"`` the held-out windows of the sources that have them, interleaved in
    proportion (``Interleave``). All sources must come from one tokenizer (the same ids for
    the same text)."""
    if not entries:
        raise DataSourceError("data.mixture: no sources")
    held_out = part == "held_out"
    sources: list[tuple[int, TokenWindowDataset]] = []
    for index, (directory, _) in enumerate(entries):
        key = f"data.mixture[{index}].tokens"
        if held_out and not source_manifest(directory, key).split("eval"):
            continue  # this source has no held-out shards; the others may
        dataset = open_token_dataset(
            directory,
            block_size=block_size,
            part=part,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            verify=verify,
            key=key,
            document_mask=document_mask,
        )
        sources.append((index, dataset))
    _same_tokenizer(sources)
    if held_out:
        if not sources:
            raise DataSourceError(
                "data.mixture: no source has held-out shards (all were prepared with "
                "--eval-fraction 0): name a held-out source with eval.text_path or eval.dataset"
            )
        return Interleave([dataset for _, dataset in sources], seed=seed)
    weights = [weight for _, weight in entries]
    quotas = apportion(sum(len(dataset) for _, dataset in sources), weights)
    for (index, _), quota in zip(sources, quotas, strict=True):
        if quota == 0:
            raise DataSourceError(
                f"data.mixture[{index}].weight: {weights[index]} is too small to draw one "
                "sample of this source in an epoch"
            )
    return MixtureDataset([dataset for _, dataset in sources], weights, seed=seed)


def _same_tokenizer(sources: Sequence[tuple[int, TokenWindowDataset]]) -> None:
    if not sources:
        return
    first = sources[0][1]
    expected = first.manifest.tokenizer.sha256
    for index, source in sources[1:]:
        found = source.manifest.tokenizer.sha256
        if found != expected:
            raise DataSourceError(
                f"data.mixture[{index}].tokens: {source.directory} was prepared with another "
                f"tokenizer than {first.directory} (sha256 {found[:12]}... vs "
                f"{expected[:12]}...): mix sources of one tokenizer"
            )
