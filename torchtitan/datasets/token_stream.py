"""Token streams over memory-mapped shards, and the deterministic mixture of several (a blend).

`TokenStream`: pieces of shards (a shard's tokens, or a range of its documents) concatenated into one stream that
repeats forever; `window(start, length)` reads only the tokens of the window and, from the index, where documents
begin in it. Its memory does not grow with the corpus: the shards stay on disk, mapped.

`Mixture`: sample i comes from one source, chosen by a fixed schedule of `PERIOD` samples that Megatron's blending
rule builds (each next sample goes to the source furthest below its weight), repeated; it is sample j of that source,
j counting the source's own samples. Any sample index maps to (source, j) in O(1), so resume, the data-parallel split
and the per-source counts need no state beyond the global sample index.
"""

import os
from dataclasses import dataclass

import numpy as np

from torchtitan.datasets.corpus import DatasetError
from torchtitan.datasets.indexed import IndexedShard

PERIOD = 10_000
"""Samples in the mixture's repeating schedule: each source's share is exact to 1 / PERIOD over every period."""


@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of a shard; `start` is a document start."""

    shard: IndexedShard
    start: int
    end: int


class TokenStream:
    """The pieces' tokens back to back, repeating forever (epoch after epoch, same order)."""

    def __init__(self, pieces: list[Piece], name: str, vocab_size: int | None = None):
        """vocab_size: check every window's ids against it (sources without a manifest, whose largest id is unknown)."""
        self.pieces = [piece for piece in pieces if piece.end > piece.start]
        self.name = name
        self.vocab_size = vocab_size
        if not self.pieces:
            raise DatasetError(f"{name}: no tokens")
        lengths = [piece.end - piece.start for piece in self.pieces]
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # (pieces + 1,)
        self.num_tokens = int(self.offsets[-1])

    def window(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64, document ids int32) of stream positions [start, start + length), wrapping at the end. A
        document id changes exactly where a document begins (ids are relative to the window)."""
        tokens = np.empty(length, np.int64)
        begins = np.zeros(length, np.int32)
        position, filled = start % self.num_tokens, 0
        while filled < length:
            index = int(np.searchsorted(self.offsets, position, side="right")) - 1
            piece = self.pieces[index]
            first = piece.start + position - int(self.offsets[index])
            take = min(length - filled, piece.end - first)
            tokens[filled : filled + take] = ids = piece.shard.tokens(first, first + take)
            if self.vocab_size is not None and ids.size and ids.max() >= self.vocab_size:
                raise DatasetError(
                    f"{piece.shard.bin_path} holds token id {int(ids.max())} (near token {first:,}), past the "
                    f"model's vocabulary of {self.vocab_size:,}: it was tokenized with another tokenizer; tokenize "
                    "it again, or use a model whose vocab_size covers it"
                )
            begins[piece.shard.document_starts(first, first + take) - first + filled] = 1
            begins[filled] = 1 if first == piece.start else begins[filled]  # a piece starts at a document
            filled += take
            position = (position + take) % self.num_tokens
        return tokens, np.cumsum(begins, dtype=np.int32)


class Mixture:
    """Samples of several token streams by weight (one stream: its windows in order). Sample j of a source is the
    window of `sample_tokens` tokens at j * sample_tokens of its stream."""

    def __init__(self, streams: list[TokenStream], weights: list[float], sample_tokens: int):
        if len(streams) != len(weights) or not streams:
            raise ValueError("a mixture needs one weight per stream")
        if any(not w >= 0 for w in weights) or sum(weights) <= 0:
            raise DatasetError(f"blend weights must be >= 0 and not all zero; got {weights}")
        self.streams = streams
        self.sample_tokens = sample_tokens
        total = sum(weights)
        self.weights = np.array([w / total for w in weights])
        period = 1 if len(streams) == 1 else PERIOD
        self.schedule = _blend_schedule(self.weights, period)  # (period,) the source of each sample
        counts = np.zeros((period + 1, len(streams)), np.int64)
        counts[np.arange(1, period + 1), self.schedule] = 1
        self.cumulative = counts.cumsum(axis=0)  # (period + 1, sources): samples of each before position p

    @property
    def names(self) -> list[str]:
        """A short name of each source (its path's last part), unique: `_2`, `_3` ... after repeats."""
        bases = [os.path.basename(stream.name.rstrip("/")) or stream.name for stream in self.streams]
        repeats = [bases[:i].count(base) for i, base in enumerate(bases)]
        return [base if not n else f"{base}_{n + 1}" for base, n in zip(bases, repeats, strict=True)]

    def realized_shares(self) -> np.ndarray:
        return self.cumulative[-1] / self.cumulative[-1].sum()

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, document ids) of global sample `index`."""
        source, within = self.locate(index)
        return self.streams[source].window(within * self.sample_tokens, self.sample_tokens)

    def locate(self, index: int) -> tuple[int, int]:
        """Sample `index` -> (its source, its index among that source's samples)."""
        period = len(self.schedule)
        cycle, position = divmod(index, period)
        source = int(self.schedule[position])
        return source, cycle * int(self.cumulative[-1, source]) + int(self.cumulative[position, source])

    def samples_per_source(self, num_samples: int) -> np.ndarray:
        """How many of the first `num_samples` samples each source gave."""
        cycle, position = divmod(num_samples, len(self.schedule))
        return cycle * self.cumulative[-1] + self.cumulative[position]


def _blend_schedule(weights: np.ndarray, period: int) -> np.ndarray:
    """Megatron's greedy blend: sample i goes to the source whose count is furthest below weight x (i + 1)."""
    counts = np.zeros(len(weights), np.int64)
    schedule = np.empty(period, np.int64)
    for i in range(period):
        source = int(np.argmax(weights * (i + 1) - counts))
        schedule[i] = source
        counts[source] += 1
    return schedule
