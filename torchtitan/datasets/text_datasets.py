"""The packed, data-parallel-sharded sample stream built from a local corpus (its files: `corpus.py`).

Packing (`PackedTextDataset`): every document becomes BOS + tokens + EOS; the documents are concatenated into
one token stream that repeats forever (epoch after epoch, same order). Sample i is the window of seq_len + 1
tokens starting at i * (seq_len + 1) in that endless stream, so samples span document (and epoch) boundaries,
nothing is padded and no token is dropped; input = window[:-1], labels = window[1:].

Data-parallel sharding: the sample stream is global. With local batch size L and dp world size W, rank r takes
the samples whose index i has (i // L) % W == r, so step t of rank r is samples (t * W + r) * L ... + L - 1, and
one rank with batch W * L sees exactly the concatenation (rank 0 first) of what W ranks with batch L see.
"""

import contextlib
import hashlib
import logging
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.corpus import (
    CACHE_DIR_ENV,
    DatasetError,
    describe_corpus,
    disk_cache_dir,
    empty_corpus_error,
    read_documents,
    resolve_corpus_files,
)
from torchtitan.datasets.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class PackedTextDataset(IterableDataset):
    """Endless stream of packed (input_dict, labels) samples for one data-parallel rank.

    Every rank holds the whole token stream: simple and exactly reproducible for any dp degree, at the cost of W-fold
    memory (fine up to tens of millions of tokens; a large corpus would need pre-tokenized shards).
    State: this rank's (per loader worker) samples yielded, and the epoch the next sample starts in.
    """

    def __init__(
        self, token_stream: torch.Tensor, seq_len: int, local_batch_size: int, dp_rank: int, dp_world_size: int
    ):
        if token_stream.ndim != 1 or token_stream.numel() == 0:
            raise ValueError("token_stream must be a non-empty 1-D tensor of token ids")
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and local_batch_size ({local_batch_size}) must be >= 1")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world_size={dp_world_size})")
        self.token_stream = token_stream
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._samples_yielded = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            window = self.sample(self._global_sample_index(self._samples_yielded))
            self._samples_yielded += 1
            yield {"input": window[:-1]}, window[1:]

    def sample(self, sample_index: int) -> torch.Tensor:
        """Window `sample_index` of the endless stream: seq_len + 1 token ids, wrapping into the next epoch."""
        num_tokens = self.token_stream.numel()
        start = sample_index * (self.seq_len + 1) % num_tokens
        end = start + self.seq_len + 1
        if end <= num_tokens:  # a slice: indexing by positions is far slower
            return self.token_stream[start:end].clone()
        return self.token_stream[torch.arange(start, end) % num_tokens]

    def _global_sample_index(self, local_index: int) -> int:
        # N loader workers hand out whole batches round-robin: worker w builds this rank's batches w, w + N, ...
        worker = get_worker_info()
        num_workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        local_batch = (local_index // self.local_batch_size) * num_workers + worker_id
        global_batch = local_batch * self.dp_world_size + self.dp_rank
        return global_batch * self.local_batch_size + local_index % self.local_batch_size

    def state_dict(self) -> dict[str, int]:
        next_sample = self._global_sample_index(self._samples_yielded)
        epoch = next_sample * (self.seq_len + 1) // self.token_stream.numel()
        return {"samples_yielded": self._samples_yielded, "epoch": epoch}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._samples_yielded = int(state_dict["samples_yielded"])


def build_text_dataset(
    job_config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_world_size: int, split: str = "train"
) -> tuple[PackedTextDataset, dict[str, Any]]:
    """The packed dataset of `split` ("train" or "validation") for this rank and its identity (what a resumed run
    must match, but `dataset`). Validation without a corpus of its own holds out training documents."""
    training, validation = job_config.training, job_config.validation
    held_out = validation.enable and validation.dataset_path is None
    source = validation if split == "validation" and not held_out else training
    name = "training" if source is training else "validation"
    files = resolve_corpus_files(training.dataset, source.dataset_path, name)
    if split == "train" or not held_out:  # a held-out split reads the training corpus, already described
        logger.info(f"{name} {describe_corpus(files, source.dataset_path)}")
    token_stream, num_documents = tokenize_corpus(files, tokenizer)
    if held_out:
        token_stream, num_documents = split_documents(token_stream, tokenizer.bos_id, split == "validation")
    seq_len, batch_size = training.seq_len, training.local_batch_size
    if split == "validation":
        seq_len, batch_size = validation.seq_len or seq_len, validation.local_batch_size or batch_size
    step_tokens = (seq_len + 1) * batch_size * dp_world_size  # what one step (or validation batch) reads
    if split == "train" and token_stream.numel() < step_tokens:
        logger.warning(
            f"the training corpus holds {token_stream.numel()} tokens, fewer than one step reads ({step_tokens}): "
            "every step repeats it; give a larger --training.dataset_path"
        )
    if split == "validation":
        held = token_stream.numel() // step_tokens  # batches without repeating
        if validation.steps > held:
            raise DatasetError(
                f"validation.steps={validation.steps} needs more batches than the validation set holds ({held} of "
                f"{dp_world_size} x {batch_size} x {seq_len} tokens): lower --validation.steps, or give a larger "
                "--validation.dataset_path"
            )
    dataset = PackedTextDataset(token_stream, seq_len, batch_size, dp_rank, dp_world_size)
    identity = {
        "dataset": training.dataset if source.dataset_path is None else str(source.dataset_path),
        "tokens_sha256": hashlib.sha256(token_stream.numpy().tobytes()).hexdigest()[:16],
        "num_documents": num_documents,
        "num_tokens": token_stream.numel(),
        "tokenizer": tokenizer.fingerprint,
        "seq_len": seq_len,
        "local_batch_size": batch_size,
        "dp_world_size": dp_world_size,
    }
    return dataset, identity


def split_documents(token_stream: torch.Tensor, bos_id: int, held_out: bool, every: int = 20) -> tuple:
    """The held-out documents of a token stream (each starts at its BOS token): every `every`-th one, from the
    `every`-th on; or (held_out False) the others. Returns their tokens and their number."""
    document = (token_stream == bos_id).cumsum(0) - 1  # (tokens,) the document of each token
    in_split = (document % every == every - 1) == held_out
    if not in_split.any():
        raise DatasetError(
            f"the training corpus has {int(document[-1]) + 1} documents, too few to hold out every {every}th for "
            "validation: give a validation corpus (--validation.dataset_path)"
        )
    return token_stream[in_split], int(document[in_split].unique().numel())


# Tokenized corpora are cached on disk, keyed by (files with their size and mtime, tokenizer fingerprint, format):
# every rank of every later run loads the token stream instead of tokenizing again (seconds, even for a small corpus).
_CACHE_FORMAT = 1  # bump when the token stream a corpus maps to changes (BOS/EOS rules, document reading)


def tokenize_corpus(files: list[Path], tokenizer: Tokenizer) -> tuple[torch.Tensor, int]:
    """(token stream: BOS + doc + EOS for every document, concatenated, int64; number of documents)."""
    file_stats = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    key = (file_stats, tokenizer.fingerprint, _CACHE_FORMAT)
    cache_file = disk_cache_dir() / "tokenized" / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:32]}.pt"
    cached = _load_tokenized(cache_file)
    if cached is None:
        documents = [doc for f in files for doc in read_documents(f) if doc]
        if not any(doc.strip() for doc in documents):
            raise empty_corpus_error(files)
        token_lists = tokenizer.encode_batch(documents, add_bos=True, add_eos=True)
        cached = (torch.cat([torch.tensor(ids, dtype=torch.int64) for ids in token_lists]), len(documents))
        _save_tokenized(cache_file, *cached)
    return cached


def _load_tokenized(path: Path) -> tuple[torch.Tensor, int] | None:
    """The cached (token stream, number of documents), or None when absent, unreadable or not matching its checksum
    (then it is rebuilt)."""
    try:
        saved = torch.load(path, weights_only=True)
        tokens, num_documents, checksum = saved["tokens"], int(saved["num_documents"]), saved["checksum"]
    except FileNotFoundError:
        return None
    except Exception as err:  # a damaged cache must never stop training: tokenize again
        logger.warning(f"ignoring the unreadable tokenized-corpus cache {path} ({err}); tokenizing again")
        return None
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tokens.ndim != 1:
        logger.warning(f"ignoring the tokenized-corpus cache {path}: not a 1-D int64 token stream; tokenizing again")
        return None
    if checksum != _token_checksum(tokens, num_documents):
        logger.warning(f"ignoring the tokenized-corpus cache {path}: its checksum does not match; tokenizing again")
        return None
    return tokens, num_documents


def _token_checksum(tokens: torch.Tensor, num_documents: int) -> int:
    return zlib.crc32(str(num_documents).encode(), zlib.crc32(tokens.contiguous().numpy()))


def _save_tokenized(path: Path, tokens: torch.Tensor, num_documents: int) -> None:
    """Atomic (write, then rename), so concurrent ranks and a crash never leave a partial file behind."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        checksum = _token_checksum(tokens, num_documents)
        torch.save({"tokens": tokens, "num_documents": num_documents, "checksum": checksum}, tmp)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):  # e.g. the cache path is a file: there is no tmp file to remove
            tmp.unlink(missing_ok=True)
        logger.warning(f"could not cache the tokenized corpus in {path.parent} ({err}); set {CACHE_DIR_ENV}")
