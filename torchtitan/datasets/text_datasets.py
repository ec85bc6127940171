"""The packed, data-parallel-sharded sample stream over a job's sources (shards, Megatron files, raw corpora).

Packing: every document is BOS + tokens + EOS (as the shards store it; Megatron files as their builder wrote them),
the documents of a source concatenated into one token stream that repeats forever (epoch after epoch, same order).
Sample i of a source is the window of seq_len + 1 tokens starting at i * (seq_len + 1) in that stream, so samples span
document (and epoch) boundaries, nothing is padded and no token is dropped; input = window[:-1], labels =
window[1:]. With a blend, global sample i is sample j of the source the blend's schedule gives it (token_stream.py).

Data-parallel sharding: the sample stream is global. With local batch size L and dp world size W, rank r takes
the samples whose index i has (i // L) % W == r, so step t of rank r is samples (t * W + r) * L ... + L - 1, and
one rank with batch W * L sees exactly the concatenation (rank 0 first) of what W ranks with batch L see.
"""

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.corpus import DatasetError
from torchtitan.datasets.shards import Source, open_source, training_sources
from torchtitan.datasets.token_stream import Mixture
from torchtitan.datasets.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SplitLayout:
    """How one data-parallel rank reads a split ("train" or "validation"), whatever the data's format: the split's
    sequence length and local batch size (validation's own where it sets them, else training's) and the rank's place
    among `dp_world_size`."""

    split: str
    seq_len: int
    local_batch_size: int
    dp_rank: int
    dp_world_size: int

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.local_batch_size < 1:
            raise ValueError(f"seq_len ({self.seq_len}) and local_batch_size ({self.local_batch_size}) must be >= 1")
        if not 0 <= self.dp_rank < self.dp_world_size:
            raise ValueError(f"dp_rank {self.dp_rank} is outside [0, dp_world_size={self.dp_world_size})")

    @classmethod
    def of(cls, job_config: JobConfig, dp_rank: int, dp_world_size: int, split: str = "train") -> "SplitLayout":
        training = job_config.training
        own = job_config.validation if split == "validation" else training
        seq_len, local_batch_size = own.seq_len or training.seq_len, own.local_batch_size or training.local_batch_size
        return cls(split, seq_len, local_batch_size, dp_rank, dp_world_size)

    @property
    def samples_per_step(self) -> int:
        """Samples one step reads over all ranks."""
        return self.local_batch_size * self.dp_world_size

    def identity(self) -> dict[str, int]:
        """The layout's entries of a dataset's identity (`build_text_dataset`)."""
        return {"seq_len": self.seq_len, "local_batch_size": self.local_batch_size, "dp_world_size": self.dp_world_size}


class PackedTextDataset(IterableDataset):
    """Endless stream of packed ({"input", "document_ids"}, labels) samples for one data-parallel rank.

    document_ids (seq_len + 1,) int32: the window's document of each token (from the shards' index), for block-causal
    attention (`[:-1]`) and MTP targets that never cross a document. State: this rank's (per loader worker) samples
    yielded; everything else follows from the global sample index.
    """

    def __init__(self, mixture: Mixture, layout: SplitLayout):
        if mixture.sample_tokens != layout.seq_len + 1:
            raise ValueError(f"the mixture's samples are {mixture.sample_tokens} tokens, not seq_len + 1")
        self.mixture = mixture
        self.seq_len = layout.seq_len
        self.local_batch_size = layout.local_batch_size
        self.dp_rank = layout.dp_rank
        self.dp_world_size = layout.dp_world_size
        self._samples_yielded = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            tokens, document_ids = self.mixture.sample(self._global_sample_index(self._samples_yielded))
            self._samples_yielded += 1
            window = torch.from_numpy(tokens)
            yield {"input": window[:-1], "document_ids": torch.from_numpy(document_ids)}, window[1:]

    def _global_sample_index(self, local_index: int) -> int:
        # N loader workers hand out whole batches round-robin: worker w builds this rank's batches w, w + N, ...
        worker = get_worker_info()
        num_workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        local_batch = (local_index // self.local_batch_size) * num_workers + worker_id
        global_batch = local_batch * self.dp_world_size + self.dp_rank
        return global_batch * self.local_batch_size + local_index % self.local_batch_size

    def tokens_per_source(self, num_samples: int) -> dict[str, int]:
        """Tokens trained from each source over the first `num_samples` global samples."""
        counts = self.mixture.samples_per_source(num_samples)
        return {name: int(count) * self.seq_len for name, count in zip(self.mixture.names, counts, strict=True)}

    def state_dict(self) -> dict[str, int]:
        return {"samples_yielded": self._samples_yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._samples_yielded = int(state_dict["samples_yielded"])


def build_text_dataset(
    job_config: JobConfig, tokenizer: Tokenizer, vocab_size: int, layout: SplitLayout
) -> tuple[PackedTextDataset, dict[str, Any]]:
    """The packed dataset of `layout`'s split for its rank and its identity (what a resumed run must match, but
    `dataset`). Validation without a corpus of its own holds the last 1/20 of every shard's documents out of training
    (`Source.stream`). vocab_size: the model's; no token id may reach it."""
    training, validation = job_config.training, job_config.validation
    split = layout.split
    held_out = validation.enable and validation.dataset_path is None
    if split == "validation" and not held_out:
        weighted = [(1.0, open_source(validation.dataset_path, "", tokenizer, vocab_size, "validation"))]
        stream_split = "all"
    else:
        weighted = [
            (weight, open_source(path, training.dataset, tokenizer, vocab_size, "training"))
            for weight, path in training_sources(job_config)
        ]
        stream_split = ("validation" if split == "validation" else "train") if held_out else "all"
    streams = [source.stream(stream_split, vocab_size) for _, source in weighted]
    mixture = Mixture(streams, [weight for weight, _ in weighted], layout.seq_len + 1)
    if len(streams) > 1:
        shares = ", ".join(
            f"{name}: {share:.4f} (weight {weight:.4f})"
            for name, share, weight in zip(mixture.names, mixture.realized_shares(), mixture.weights, strict=True)
        )
        logger.info(f"{split} blend of {len(streams)} sources, samples per source: {shares}")
    _check_size(mixture, layout, job_config)
    identity = {
        "dataset": [source.name for _, source in weighted],
        "data_sha256": _data_fingerprint(weighted, stream_split),
        "num_documents": sum(source.num_documents for _, source in weighted),
        "num_tokens": sum(stream.num_tokens for stream in streams),
        "tokenizer": tokenizer.fingerprint,
        **layout.identity(),
    }
    return PackedTextDataset(mixture, layout), identity


def _check_size(mixture: Mixture, layout: SplitLayout, job_config: JobConfig) -> None:
    """Training: warn when one step reads more than a source holds. Validation: `steps` batches must fit without
    repeating a token of the held-out set."""
    split = layout.split
    steps = job_config.validation.steps if split == "validation" else 1
    per_source = mixture.samples_per_source(steps * layout.samples_per_step) * mixture.sample_tokens
    short = [(s, int(n)) for s, n in zip(mixture.streams, per_source, strict=True) if n > s.num_tokens]
    if not short:
        return
    stream, needed = short[0]
    if split == "train":
        logger.warning(
            f"the training corpus {stream.name} holds {stream.num_tokens} tokens, fewer than one step reads from it "
            f"({needed}): every step repeats it; give a larger --training.dataset_path"
        )
        return
    raise DatasetError(
        f"validation.steps={steps} needs {needed:,} tokens of {stream.name}, more than its validation set holds "
        f"({stream.num_tokens:,}; batches of {layout.dp_world_size} x {layout.local_batch_size} sequences): lower "
        "--validation.steps, or give a larger --validation.dataset_path"
    )


def _data_fingerprint(weighted: list[tuple[float, Source]], split: str) -> str:
    described = [(weight, source.fingerprint) for weight, source in weighted] + [split]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]
