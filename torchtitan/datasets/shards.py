"""A job's data sources opened as token streams: token-shard folders, Megatron-LM indexed datasets, or raw corpora.

A source path (`training.dataset_path`, each entry of `training.dataset_blend`, `validation.dataset_path`) is
- a folder with `manifest.json`: shards written by `scripts/tokenize_corpus.py` (checked against the manifest);
- a Megatron-LM indexed dataset: `PREFIX` (or `PREFIX.bin` / `PREFIX.idx`), or a folder of them without a manifest
  (every `*.idx` in sorted order), as `tools/preprocess_data.py` writes them;
- a raw corpus (`corpus.py`'s formats) of at most RAW_CORPUS_LIMIT bytes: tokenized on first use into a shard folder
  in the cache (`disk_cache_dir()/shards/`), keyed by its files and the tokenizer. A larger one is refused in one line
  that names the tokenize command.

Opening checks, before any training and in time independent of the corpus size: every shard's index header against
both files' sizes and the manifest's counts, the tokenizer the shards were written with, and that the token dtype and
the largest token id fit the vocabulary. The checksums are checked as a rank first reads a shard's index and each
16 MiB of its tokens (`IndexedShard`); `scripts/tokenize_corpus.py --verify DIR` checks every byte at once.
"""

import atexit
import hashlib
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from torchtitan.datasets.corpus import (
    CACHE_DIR_ENV,
    DatasetError,
    check_corpus,
    describe_corpus,
    disk_cache_dir,
    empty_corpus_error,
    resolve_corpus_files,
)
from torchtitan.datasets.indexed import IndexedShard, is_indexed_prefix, max_token_id, shard_prefix
from torchtitan.datasets.token_stream import Piece, TokenStream
from torchtitan.datasets.tokenize_shards import (
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    join,
    plan_parts,
    tokenize_parts,
)
from torchtitan.datasets.tokenizer import Tokenizer

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig

logger = logging.getLogger(__name__)

RAW_CORPUS_LIMIT = 100 << 20
"""Bytes of raw corpus files the trainer tokenizes on the fly; past it, `scripts/tokenize_corpus.py` first."""
HELD_OUT_EVERY = 20
"""Without a validation corpus, the last 1 / HELD_OUT_EVERY of every shard's documents is held out for validation."""
_CACHE_FORMAT = 2  # bump when the shards a raw corpus maps to change (BOS/EOS rules, document reading)


@dataclass
class Source:
    """One opened source: its shards in stream order and what identifies its data (for resume checks)."""

    name: str
    shards: list[IndexedShard]
    fingerprint: str
    num_documents: int
    megatron: bool  # no manifest: token ids are checked against the vocabulary as windows are read

    def stream(self, split: str = "all", vocab_size: int | None = None) -> TokenStream:
        """The source's tokens as a stream: "all", or without a validation corpus "train" / "validation" (the last
        1 / HELD_OUT_EVERY of each shard's documents). vocab_size: checked in every window where no manifest did."""
        vocab_size = vocab_size if self.megatron else None
        if split == "all":
            return TokenStream([Piece(shard, 0, shard.num_tokens) for shard in self.shards], self.name, vocab_size)
        pieces = []
        for shard in self.shards:
            documents = shard.index.num_documents
            boundary = shard.document_start(documents - documents // HELD_OUT_EVERY)
            pieces.append(Piece(shard, 0, boundary) if split == "train" else Piece(shard, boundary, shard.num_tokens))
        if not any(piece.end > piece.start for piece in pieces):
            raise DatasetError(
                f"{self.name}: {self.num_documents} documents, too few to hold the last 1/{HELD_OUT_EVERY} of each "
                "shard out for validation; give a validation corpus (--validation.dataset_path)"
            )
        return TokenStream(pieces, self.name, vocab_size)


def open_source(path: str | None, dataset: str, tokenizer: Tokenizer, vocab_size: int, section: str) -> Source:
    """The source at `path` (None: the built-in `dataset`), checked against the tokenizer and the model's vocabulary."""
    flag = f"--{section}.dataset_path={path!r}" if path is not None else f"--{section}.dataset={dataset!r}"
    if path is not None:
        folder = Path(path).expanduser()
        if (folder / MANIFEST).is_file():
            return _open_shard_folder(folder, tokenizer, vocab_size)
        prefixes = megatron_prefixes(folder)
        if prefixes:
            return _open_megatron(prefixes, str(folder), tokenizer, vocab_size)
    files = resolve_corpus_files(dataset, path, section)
    check_raw_size(files, flag)
    logger.info(f"{section} {describe_corpus(files, path)}")
    folder = _cached_shards(files, tokenizer)
    try:
        _read_shard_folder(folder)
    except DatasetError as err:  # a damaged cache must never stop training: tokenize again
        logger.warning(f"ignoring the damaged tokenized-corpus cache {folder} ({err}); tokenizing again")
        shutil.rmtree(folder, ignore_errors=True)
        folder = _cached_shards(files, tokenizer)
    return _open_shard_folder(folder, tokenizer, vocab_size, name=path or dataset)


def training_sources(job_config: "JobConfig") -> list[tuple[float, str | None]]:
    """(weight, path) of each training source: the blend's entries, or the one dataset_path (None: the built-in)."""
    training = job_config.training
    if training.dataset_blend:
        return parse_blend(training.dataset_blend)
    return [(1.0, training.dataset_path)]


def parse_blend(entries: list[str]) -> list[tuple[float, str]]:
    """`["WEIGHT:PATH", ...]` -> [(weight, path)]; weights >= 0, not all zero (they are normalized)."""
    parsed = []
    for entry in entries:
        weight, sep, path = entry.partition(":")
        try:
            value = float(weight)
        except ValueError:
            value = None
        if not sep or not path or value is None:
            raise DatasetError(
                f"--training.dataset_blend entry {entry!r} is not WEIGHT:PATH; write e.g. "
                "--training.dataset_blend 0.7:/data/web_shards,0.3:/data/code_text_document"
            )
        if not value >= 0 or value == float("inf"):
            raise DatasetError(f"--training.dataset_blend entry {entry!r}: the weight must be a number >= 0")
        parsed.append((value, path))
    if sum(weight for weight, _ in parsed) <= 0:
        raise DatasetError(f"--training.dataset_blend weights are all zero ({entries}); give at least one > 0")
    return parsed


def check_sources(job_config: "JobConfig") -> None:
    """Preflight, before the model and torch: every source of the job opens (the blend parses; a shard folder's
    manifest, every shard's index header, sizes and index checksum; a raw corpus's files and their first records, and
    its size). The tokenizer and vocabulary checks come when the trainer opens them (`open_source`)."""
    training, validation = job_config.training, job_config.validation
    if training.dataset_blend and training.dataset_path is not None:
        raise DatasetError(
            "--training.dataset_path and --training.dataset_blend are both set: give the one path as a blend entry "
            "(e.g. 1:PATH) or drop the blend"
        )
    for _, path in training_sources(job_config):
        _check_source(path, training.dataset, "training")
    if validation.enable and validation.dataset_path:
        _check_source(validation.dataset_path, "", "validation")


def _check_source(path: str | None, dataset: str, section: str) -> None:
    if path is not None:
        folder = Path(path).expanduser()
        if (folder / MANIFEST).is_file():
            manifest = read_manifest(folder)
            for entry in manifest["shards"]:
                _manifest_shard(folder, entry)
            return
        if prefixes := megatron_prefixes(folder):
            for prefix in prefixes:
                IndexedShard(prefix)
            return
    files = resolve_corpus_files(dataset, path, section)
    check_raw_size(files, f"--{section}.dataset_path={path!r}")
    check_corpus(dataset, path, section)


def megatron_prefixes(path: Path) -> list[Path]:
    """The Megatron indexed datasets at `path`: itself (a prefix, .bin or .idx), or a folder's `*.idx` without a
    manifest (sorted); [] when `path` is none of those."""
    if path.is_dir():
        return sorted(shard_prefix(idx) for idx in path.glob("*.idx")) if not (path / MANIFEST).exists() else []
    return [shard_prefix(path)] if is_indexed_prefix(path) else []


def check_raw_size(files: list[Path], flag: str) -> None:
    """A raw corpus past RAW_CORPUS_LIMIT is refused: tokenizing it on every rank would take long and its token stream
    is better written once, in parallel."""
    size = sum(f.stat().st_size for f in files)
    if size > RAW_CORPUS_LIMIT:
        source = flag.partition("=")[2].strip("'")
        raise DatasetError(
            f"{flag} holds {size / 2**20:,.0f} MiB of raw text, more than the trainer tokenizes on the fly "
            f"({RAW_CORPUS_LIMIT >> 20} MiB): tokenize it once with `python scripts/tokenize_corpus.py {source} "
            "--out DIR --tokenizer <tokenizer.json> --workers N` and pass --training.dataset_path DIR"
        )


def _open_shard_folder(folder: Path, tokenizer: Tokenizer, vocab_size: int, name: str | None = None) -> Source:
    """A shard folder checked against its manifest (`_read_shard_folder`), then against the job: its tokenizer, and
    the model's vocabulary (`vocab_size`, which may be larger than the tokenizer's)."""
    manifest, shards = _read_shard_folder(folder)
    written_with = manifest["tokenizer"]
    if written_with["fingerprint"] != tokenizer.fingerprint:
        raise DatasetError(
            f"{folder} was tokenized with another tokenizer ({written_with['path']}, fingerprint "
            f"{written_with['fingerprint']}) than the job's ({tokenizer.path}, {tokenizer.fingerprint}): pass that "
            "--model.tokenizer_path, or tokenize the corpus again with the job's tokenizer"
        )
    for shard, entry in zip(shards, manifest["shards"], strict=True):
        _check_dtype(shard, tokenizer.vocab_size)
        if entry["max_token_id"] >= vocab_size:
            raise DatasetError(
                f"{shard.bin_path} holds token id {entry['max_token_id']}, past the model's vocabulary of "
                f"{vocab_size:,}: the shards were written with another tokenizer; tokenize again, or use a model "
                "whose vocab_size covers it"
            )
    fingerprint = hashlib.sha256(json.dumps([s["idx_crc32"] for s in manifest["shards"]]).encode()).hexdigest()[:16]
    return Source(name or str(folder), shards, fingerprint, manifest["num_documents"], megatron=False)


def _read_shard_folder(folder: Path) -> tuple[dict, list[IndexedShard]]:
    """The manifest and its shards, each checked against its entry: what a damaged folder fails."""
    manifest = read_manifest(folder)
    return manifest, [_manifest_shard(folder, entry) for entry in manifest["shards"]]


def _manifest_shard(folder: Path, entry: dict) -> IndexedShard:
    """A manifest's shard, opened and checked against its entry (sizes, counts; its checksums as it is read)."""
    shard = IndexedShard(folder / entry["name"], entry["chunk_crc32"], entry["idx_crc32"])
    if shard.num_tokens != entry["num_tokens"] or shard.index.num_documents != entry["num_documents"]:
        raise DatasetError(
            f"{shard.idx_path} indexes {shard.num_tokens:,} tokens in {shard.index.num_documents:,} documents, "
            f"the manifest {entry['num_tokens']:,} in {entry['num_documents']:,}: the index does not match its "
            "shard; tokenize the corpus again (finished shards that still match are kept)"
        )
    return shard


def _open_megatron(prefixes: list[Path], name: str, tokenizer: Tokenizer, vocab_size: int) -> Source:
    shards = [IndexedShard(prefix) for prefix in prefixes]
    for shard in shards:
        _check_dtype(shard, tokenizer.vocab_size)
    # what identifies the data without reading it: each file's name and counts (the corpus may move)
    described = [(shard.prefix.name, shard.num_tokens, shard.index.num_documents) for shard in shards]
    fingerprint = hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]
    num_documents = sum(shard.index.num_documents for shard in shards)
    logger.info(f"Megatron indexed dataset {name}: {len(shards)} file(s), {num_documents:,} documents")
    return Source(name, shards, fingerprint, num_documents, megatron=True)


def _check_dtype(shard: IndexedShard, vocab_size: int) -> None:
    """The shard's token dtype holds every id of the tokenizer's `vocab_size` (a smaller one cut ids when written)."""
    dtype = shard.index.dtype
    if np.issubdtype(dtype, np.unsignedinteger) and max_token_id(dtype) < vocab_size - 1 and dtype.itemsize < 4:
        raise DatasetError(
            f"{shard.idx_path} stores {dtype.name} tokens (ids up to {max_token_id(dtype):,}), too small for the "
            f"tokenizer's vocabulary of {vocab_size:,}: the shards were written for a smaller vocabulary; tokenize "
            "again with the job's tokenizer"
        )


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DatasetError(f"{path} is not readable JSON ({err}); tokenize the corpus again to rewrite it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DatasetError(f"{path} is not a token-shard manifest of scripts/tokenize_corpus.py; tokenize again")
    if manifest.get("version") != MANIFEST_VERSION:
        raise DatasetError(
            f"{path} is manifest version {manifest.get('version')}; this trainer reads version {MANIFEST_VERSION}: "
            "tokenize the corpus again"
        )
    return manifest


def _cached_shards(files: list[Path], tokenizer: Tokenizer) -> Path:
    """The shard folder of a raw corpus in the cache, tokenized now if absent (in this process; concurrent ranks each
    write a temporary folder of their own, and the first rename wins). A cache that cannot be written costs only
    this run's tokenizing: the shards go to a temporary folder, removed at exit."""
    file_stats = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    key = hashlib.sha256(repr((file_stats, tokenizer.fingerprint, _CACHE_FORMAT)).encode()).hexdigest()[:32]
    folder = disk_cache_dir() / "shards" / key
    if (folder / MANIFEST).is_file():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=folder.parent))
    except OSError as err:
        logger.warning(
            f"cannot cache the tokenized corpus in {folder.parent} ({err.strerror or err}): tokenizing it for this run "
            f"only; set {CACHE_DIR_ENV} to a writable folder"
        )
        tmp = Path(tempfile.mkdtemp(prefix="torchtitan-shards-"))
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        _tokenize_raw(files, tokenizer, tmp)
        return tmp
    try:
        _tokenize_raw(files, tokenizer, tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another rank's rename came first
            if not (folder / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _tokenize_raw(files: list[Path], tokenizer: Tokenizer, out_dir: Path) -> None:
    try:
        parts = plan_parts(files)
        tokenize_parts(parts, out_dir, tokenizer.path)
        manifest = join(out_dir, parts, tokenizer.path)
    except OSError as err:
        raise DatasetError(
            f"cannot write the tokenized corpus to {out_dir} ({err.strerror or err}); point {CACHE_DIR_ENV} at a "
            "writable folder with room for it"
        ) from None
    if not any(shard["text_documents"] for shard in manifest["shards"]):
        raise empty_corpus_error(files)
