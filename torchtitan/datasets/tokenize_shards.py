"""Tokenize a corpus into token shards: Megatron indexed datasets (`indexed.py`) plus one `manifest.json`.

The corpus (any file or folder `corpus.py` reads) is cut into parts (`plan_parts`): a file, a byte range of a large
.jsonl, or a run of a Parquet file's row groups, each about `part_bytes` of text. Part i becomes shard
`shard-{i:06d}.bin/.idx` holding its documents in order, each as BOS + tokens + EOS, so the shards concatenated are
the token stream the trainer packs (see text_datasets). A finished shard is marked by `shard-{i:06d}.json` (its
part, the tokenizer and the checksums), written last: after a kill, marked shards are checked and kept, anything else
is redone. `join` writes the manifest once every part is marked, so N independent processes (a Slurm array, any
scheduler) can each tokenize the parts i with i % N == their index, and one final step joins them.

Memory per worker is bounded by a batch of documents (`BATCH_CHARS`), whatever the file sizes.
"""

import json
import logging
import multiprocessing
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from torchtitan.datasets.corpus import DatasetError, iter_documents, iter_text_pieces
from torchtitan.datasets.document_encoder import DocumentEncoder, EncoderMismatch
from torchtitan.datasets.indexed import CHUNK_BYTES, IndexedShardWriter, file_crc32, token_dtype
from torchtitan.datasets.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "torchtitan token shards"
MANIFEST_VERSION = 1
PART_BYTES = 256 << 20
"""Text per part (one shard, one task of a worker) when a file is large enough to be cut."""
BATCH_CHARS = 4 << 20
"""Characters of documents a worker encodes at once: its memory bound."""


@dataclass(frozen=True)
class Part:
    """A piece of the corpus that becomes one shard: a whole file, a .jsonl's byte range or Parquet row groups."""

    path: str
    start: int = 0
    end: int = -1  # -1: the whole file

    def describe(self) -> str:
        if self.end < 0:
            return self.path
        unit = "row groups" if self.path.lower().endswith(".parquet") else "bytes"
        return f"{self.path} ({unit} {self.start}-{self.end})"


def plan_parts(files: list[Path], part_bytes: int = PART_BYTES) -> list[Part]:
    """The corpus's parts in document order; the same files and sizes always give the same parts."""
    parts = []
    for path in files:
        name, size = path.name.lower(), path.stat().st_size
        if name.endswith(".jsonl") and size > part_bytes:
            bounds = list(range(0, size, part_bytes)) + [size]
            parts += [Part(str(path), a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        elif name.endswith(".parquet") and size > part_bytes:
            parts += _row_group_parts(path, part_bytes)
        else:
            parts.append(Part(str(path)))
    return parts


def _row_group_parts(path: Path, part_bytes: int) -> list[Part]:
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    parts, first, filled = [], 0, 0
    for group in range(metadata.num_row_groups):
        filled += metadata.row_group(group).total_byte_size
        if filled >= part_bytes or group == metadata.num_row_groups - 1:
            parts.append(Part(str(path), first, group + 1))
            first, filled = group + 1, 0
    return parts


def shard_name(index: int) -> str:
    return f"shard-{index:06d}"


def tokenize_parts(
    parts: list[Part], out_dir: Path, tokenizer_path: Path, workers: int = 1, only: tuple[int, int] | None = None
) -> dict:
    """Tokenize the parts not yet marked done (with `only=(i, n)`, those whose index is i mod n) into `out_dir`, in
    `workers` processes (1: this process). Returns {"parts", "text_bytes", "seconds", "peak_rss_mib",
    "parts_by_encoder", "checked_documents"} of the work done here."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(tokenizer_path)
    encoder = DocumentEncoder(tokenizer)
    if encoder.backend != "tiktoken":
        logger.info("encoding with tokenizers: %s", encoder.why_not_tiktoken)
    todo = [
        (i, part)
        for i, part in enumerate(parts)
        if (only is None or i % only[1] == only[0]) and not shard_done(out_dir, i, part, tokenizer.fingerprint)
    ]
    started = time.perf_counter()
    if workers <= 1 or len(todo) <= 1:
        done = [tokenize_part(encoder, part, out_dir, i) for i, part in todo]
    else:
        # each worker encodes on one thread: the processes are the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        context = multiprocessing.get_context("spawn")
        with context.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_path),)) as pool:
            done = list(pool.imap_unordered(_tokenize_in_worker, [(part, str(out_dir), i) for i, part in todo]))
    return {
        "parts": len(todo),
        "text_bytes": sum(d["text_bytes"] for d in done),
        "seconds": time.perf_counter() - started,
        "peak_rss_mib": max((d["peak_rss_mib"] for d in done), default=0),
        "parts_by_encoder": {name: sum(d["encoder"] == name for d in done) for name in {d["encoder"] for d in done}},
        "checked_documents": sum(d["checked_documents"] for d in done),
    }


def tokenize_part(encoder: DocumentEncoder, part: Part, out_dir: Path, index: int) -> dict:
    """One part -> its shard and done-marker, with the encoder's backend, or `tokenizers` alone when a checked document
    differs (document_encoder.py). A leftover of an interrupted run is overwritten."""
    started, tokenizer = time.perf_counter(), encoder.tokenizer
    try:
        entry, text_bytes = _write_shard(encoder, part, out_dir, index)
    except EncoderMismatch as mismatch:
        logger.warning("%s; part %d (%s) is encoded again with tokenizers alone", mismatch, index, part.describe())
        encoder = DocumentEncoder(tokenizer, fast=False)
        entry, text_bytes = _write_shard(encoder, part, out_dir, index)
    record = {"tokenizer": tokenizer.fingerprint, "text_bytes": text_bytes, "shard": entry}
    _write_json_atomic((out_dir / shard_name(index)).with_suffix(".json"), record)
    return {
        "text_bytes": text_bytes,
        "seconds": time.perf_counter() - started,
        "peak_rss_mib": _peak_rss_mib(),
        "encoder": encoder.backend,
        "why_not_tiktoken": encoder.why_not_tiktoken,
        "checked_documents": encoder.checked_documents,
    }


def _write_shard(encoder: DocumentEncoder, part: Part, out_dir: Path, index: int) -> tuple[dict, int]:
    """The part's shard (not yet marked done): its manifest entry and the bytes of text it held."""
    tokenizer = encoder.tokenizer
    prefix = out_dir / shard_name(index)
    prefix.with_suffix(".json").unlink(missing_ok=True)
    writer = IndexedShardWriter(prefix, token_dtype(tokenizer.vocab_size))
    text_bytes, text_documents = 0, 0  # documents of more than whitespace
    path = Path(part.path)
    if path.name.lower().endswith((".txt", ".txt.gz")):  # one document, encoded in pieces
        writer.append([tokenizer.bos_id])
        for piece in iter_text_pieces(path):
            text_bytes += len(piece.encode("utf-8"))
            text_documents = text_documents or int(not piece.isspace())
            writer.append(encoder.encode(piece))
        writer.append([tokenizer.eos_id])
        writer.end_document()
    else:
        for batch in _document_batches(path, part):
            text_bytes += sum(len(doc.encode("utf-8")) for doc in batch)
            text_documents += sum(not doc.isspace() for doc in batch)
            writer.append_documents(encoder.encode_batch(batch))
    return {"name": prefix.name, "part": asdict(part), "text_documents": text_documents, **writer.finish()}, text_bytes


def _document_batches(path: Path, part: Part) -> Iterator[list[str]]:
    """The part's non-empty documents in batches of about BATCH_CHARS characters."""
    batch, chars = [], 0
    for doc in iter_documents(path, None if part.end < 0 else (part.start, part.end)):
        if not doc:
            continue
        batch.append(doc)
        chars += len(doc)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def shard_done(out_dir: Path, index: int, part: Part, tokenizer_fingerprint: str) -> bool:
    """Whether shard `index` is complete for this part and tokenizer: its marker names them and its files match the
    marker's checksums (a partial or damaged shard is redone)."""
    record = _read_marker(out_dir / f"{shard_name(index)}.json")
    if record is None or record["tokenizer"] != tokenizer_fingerprint or record["shard"]["part"] != asdict(part):
        return False
    return not shard_problems(out_dir, record["shard"])


def shard_problems(out_dir: Path, entry: dict) -> list[str]:
    """What is wrong with a shard against its manifest entry (reads all its bytes): missing files, sizes, checksums."""
    prefix = out_dir / entry["name"]
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    for path in (bin_path, idx_path):
        if not path.is_file():
            return [f"{path} is missing"]
    problems = []
    if file_crc32(idx_path) != entry["idx_crc32"]:
        problems.append(f"{idx_path}: checksum mismatch")
    size, chunks = bin_path.stat().st_size, entry["chunk_crc32"]
    if len(chunks) != -(-size // CHUNK_BYTES):
        problems.append(f"{bin_path}: {size:,} bytes, not what the manifest's {len(chunks)} chunks describe")
    else:
        for chunk, expected in enumerate(chunks):
            if file_crc32(bin_path, chunk * CHUNK_BYTES, CHUNK_BYTES) != expected:
                problems.append(f"{bin_path}: checksum mismatch in chunk {chunk} (bytes from {chunk * CHUNK_BYTES:,})")
                break
    return problems


def join(out_dir: Path, parts: list[Part], tokenizer_path: Path) -> dict:
    """Write `manifest.json` from every part's marker; a part not yet done is an error naming it."""
    tokenizer = Tokenizer(tokenizer_path)
    shards, missing = [], []
    for i, part in enumerate(parts):
        record = _read_marker(out_dir / f"{shard_name(i)}.json")
        if record is None or record["tokenizer"] != tokenizer.fingerprint or record["shard"]["part"] != asdict(part):
            missing.append(f"{i} ({part.describe()})")
        else:
            shards.append(record["shard"])
    if missing:
        raise DatasetError(
            f"{len(missing)} of {len(parts)} parts are not tokenized yet in {out_dir}: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; run the tokenize command for them (the same command resumes)"
        )
    return write_manifest(out_dir, shards, tokenizer)


def write_manifest(out_dir: Path, shards: list[dict], tokenizer: Tokenizer) -> dict:
    """`manifest.json` of shards (their entries, in stream order) written with `tokenizer`; returns it."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "tokenizer": {
            "path": str(tokenizer.path),
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
        },
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "chunk_bytes": CHUNK_BYTES,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_documents": sum(s["num_documents"] for s in shards),
        "shards": shards,
    }
    _write_json_atomic(out_dir / MANIFEST, manifest)
    return manifest


def _read_marker(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
        record["shard"]["part"], record["tokenizer"]  # noqa: B018  (the keys a marker must have)
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: the part is redone


def _write_json_atomic(path: Path, value: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_worker_encoder: DocumentEncoder | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_encoder
    _worker_encoder = DocumentEncoder(Tokenizer(tokenizer_path))


def _tokenize_in_worker(task: tuple[Part, str, int]) -> dict:
    part, out_dir, index = task
    assert _worker_encoder is not None
    return tokenize_part(_worker_encoder, part, Path(out_dir), index)
