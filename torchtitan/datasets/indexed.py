"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`): the token shards this trainer writes and reads.

`PREFIX.bin` holds the token ids of every document back to back; `PREFIX.idx` indexes them (little-endian):

    b"MMIDIDX\\x00\\x00"  uint64 version (1)  uint8 dtype code  uint64 S (sequences)  uint64 D (document_indices)
    int32 sequence_lengths[S]  int64 sequence_pointers[S] (byte offsets into .bin)  int64 document_indices[D]

`document_indices` is 0, then the sequence count after each document (D = documents + 1); Megatron's builder may end
the file with S int8 sequence modes (multimodal data), which this reader ignores. Files written by Megatron's
`tools/preprocess_data.py` read unchanged, and Megatron reads what `IndexedShardWriter` writes.

A shard is memory-mapped: opening it reads the header and checks its sizes (O(1)); the tokens and the index are read
only where a window asks (see `token_stream.py`).
"""

import bisect
import mmap
import struct
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchtitan.datasets.corpus import DatasetError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Megatron's dtype codes (megatron/core/datasets/indexed_dataset.py, DType); the format has no uint32.
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}
_FIXED_HEADER = len(INDEX_HEADER) + 8 + 1 + 8 + 8
CHUNK_BYTES = 16 << 20
"""A shard's tokens are checksummed in chunks of this many bytes: a rank verifies a chunk the first time it reads it."""
RELEASE_BYTES = 64 << 20
"""A shard drops its mapped pages from the process after this many bytes read (`IndexedShard.release`)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype of the format that holds every id below `vocab_size`: uint8, uint16, else int32 (the format
    has no uint32; Megatron's builder takes int32 past 65,500 ids too)."""
    for dtype in (np.uint8, np.uint16, np.int32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise DatasetError(f"a vocabulary of {vocab_size:,} ids does not fit the indexed format's int32 tokens")


def max_token_id(dtype: np.dtype) -> int:
    return int(np.iinfo(dtype).max)


@dataclass(frozen=True)
class ShardIndex:
    """What `PREFIX.idx` says, with the .bin's expected size."""

    dtype: np.dtype
    num_sequences: int
    num_documents: int
    num_tokens: int


class IndexedShard:
    """One memory-mapped `PREFIX.bin` / `PREFIX.idx` pair. `tokens(start, end)` and `document_starts(start, end)` read
    only the pages they need; `release()` drops this process's mapped pages (they stay in the page cache), so the
    resident memory of a rank that reads through a large corpus stays bounded. Pickles as its prefix (loader workers
    map the files again)."""

    def __init__(self, prefix: str | Path, chunk_crc32: list[int] | None = None, idx_crc32: int | None = None):
        """chunk_crc32, idx_crc32: a manifest's CRC-32 of every CHUNK_BYTES of the .bin and of the whole .idx; a chunk
        is checked the first time this process reads from it, the index the first time it looks up documents (not
        when opened: a rank of a terabyte corpus reads only what it trains on)."""
        self.prefix = shard_prefix(prefix)
        self.bin_path, self.idx_path = _paths(self.prefix)
        self.chunk_crc32 = chunk_crc32
        self.idx_crc32 = idx_crc32
        self.index = self._read_header()
        self._maps: tuple | None = None
        self._verified_chunks: set[int] = set()
        self._bytes_since_release = 0

    def __getstate__(self) -> dict:
        keys = ("prefix", "bin_path", "idx_path", "chunk_crc32", "idx_crc32", "index")
        return {key: self.__dict__[key] for key in keys}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _maps=None, _verified_chunks=set(), _bytes_since_release=0)

    @property
    def num_tokens(self) -> int:
        return self.index.num_tokens

    def tokens(self, start: int, end: int) -> np.ndarray:
        """A copy of token ids [start, end) of the shard's stream (int64)."""
        itemsize = self.index.dtype.itemsize
        if self.chunk_crc32 is not None:
            for chunk in range(start * itemsize // CHUNK_BYTES, -(-end * itemsize // CHUNK_BYTES)):
                if chunk not in self._verified_chunks:
                    self._verify_chunk(chunk)
        self._bytes_since_release += (end - start) * itemsize
        if self._bytes_since_release > RELEASE_BYTES:
            self.release()
        return self._mapped()[0][start:end].astype(np.int64)

    def _verify_chunk(self, chunk: int) -> None:
        if file_crc32(self.bin_path, chunk * CHUNK_BYTES, CHUNK_BYTES) != self.chunk_crc32[chunk]:
            raise DatasetError(
                f"{self.bin_path}: checksum mismatch in bytes {chunk * CHUNK_BYTES:,}-{(chunk + 1) * CHUNK_BYTES:,} "
                "(the shard changed or was damaged after tokenizing); tokenize the corpus again (finished shards "
                "that still match are kept)"
            )
        self._verified_chunks.add(chunk)

    def document_starts(self, start: int, end: int) -> np.ndarray:
        """The offsets in [start, end) where a document begins (int64, sorted), from the index."""
        if self.idx_crc32 is not None and file_crc32(self.idx_path) != self.idx_crc32:
            raise DatasetError(
                f"{self.idx_path}: checksum mismatch against the manifest (the index changed or was damaged after "
                "tokenizing); tokenize the corpus again (finished shards that still match are kept)"
            )
        self.idx_crc32 = None  # checked
        tokens, pointers, document_indices = self._mapped()[:3]
        itemsize = tokens.itemsize
        # bisect, not np.searchsorted: the index's arrays sit at unaligned offsets, where numpy copies them whole
        first, last = bisect.bisect_left(pointers, start * itemsize), bisect.bisect_left(pointers, end * itemsize)
        sequences = range(first, last)
        if document_indices.size != pointers.size + 1:  # sequences grouped into documents: keep each group's first
            sequences = [s for s in sequences if _contains(document_indices, s)]
        return np.array([pointers[s] // itemsize for s in sequences], dtype=np.int64)

    def document_start(self, document: int) -> int:
        """The offset where document `document` begins (`num_tokens` for the one past the last)."""
        tokens, pointers, document_indices = self._mapped()[:3]
        sequence = int(document_indices[document])
        return int(pointers[sequence]) // tokens.itemsize if sequence < pointers.size else self.num_tokens

    def release(self) -> None:
        """Drop this process's resident pages of the mapped files (they stay in the page cache)."""
        self._bytes_since_release = 0
        if self._maps is not None:
            for mapped in self._maps[3:]:
                mapped.madvise(mmap.MADV_DONTNEED)

    def _mapped(self) -> tuple:
        if self._maps is None:
            index = self.index
            idx_map = _map(self.idx_path)
            offset = _FIXED_HEADER
            pointers = np.frombuffer(idx_map, np.int64, index.num_sequences, offset + 4 * index.num_sequences)
            offset += 12 * index.num_sequences
            document_indices = np.frombuffer(idx_map, np.int64, index.num_documents + 1, offset)
            if index.num_tokens:
                bin_map = _map(self.bin_path)
                tokens = np.frombuffer(bin_map, index.dtype, index.num_tokens)
                self._maps = (tokens, pointers, document_indices, idx_map, bin_map)
            else:
                self._maps = (np.zeros(0, index.dtype), pointers, document_indices, idx_map)
        return self._maps

    def _read_header(self) -> ShardIndex:
        """The index's header, checked against both files' sizes (a truncated or mismatched pair fails here)."""
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DatasetError(f"shard {self.prefix}: {path} is missing; restore it or tokenize the corpus again")
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(_FIXED_HEADER)
            if len(head) < _FIXED_HEADER or head[: len(INDEX_HEADER)] != INDEX_HEADER:
                raise DatasetError(
                    f"{self.idx_path} is not a Megatron indexed-dataset index (no MMIDIDX header): a damaged file, "
                    "or not one; tokenize the corpus again"
                )
            version, code, num_sequences, num_indices = struct.unpack("<QBQQ", head[len(INDEX_HEADER) :])
            if version != INDEX_VERSION:
                raise DatasetError(
                    f"{self.idx_path} is indexed-dataset version {version}; this reader knows version "
                    f"{INDEX_VERSION} (Megatron-LM's MMIDIDX): convert it with Megatron's tools or tokenize again"
                )
            dtype = DTYPE_CODES.get(code)
            if dtype is None or not np.issubdtype(dtype, np.integer):
                raise DatasetError(
                    f"{self.idx_path} holds dtype code {code}, not integer token ids; tokenize the corpus again"
                )
            arrays = 12 * num_sequences + 8 * num_indices
            if idx_size not in (_FIXED_HEADER + arrays, _FIXED_HEADER + arrays + num_sequences) or num_indices < 1:
                raise DatasetError(
                    f"{self.idx_path} is {idx_size:,} bytes, but its header describes {num_sequences:,} sequences "
                    f"and {num_indices:,} document entries: the index is truncated or damaged; tokenize the corpus "
                    "again"
                )
            num_tokens = 0
            if num_sequences:
                f.seek(_FIXED_HEADER + 4 * (num_sequences - 1))
                (last_length,) = struct.unpack("<i", f.read(4))
                f.seek(_FIXED_HEADER + 4 * num_sequences + 8 * (num_sequences - 1))
                (last_pointer,) = struct.unpack("<q", f.read(8))
                itemsize = np.dtype(dtype).itemsize
                if last_pointer % itemsize or last_length < 0:
                    raise DatasetError(f"{self.idx_path}: its last sequence entry is damaged; tokenize again")
                num_tokens = last_pointer // itemsize + last_length
        bin_size = self.bin_path.stat().st_size
        if bin_size != num_tokens * np.dtype(dtype).itemsize:
            raise DatasetError(
                f"{self.bin_path} is {bin_size:,} bytes, but {self.idx_path.name} indexes {num_tokens:,} "
                f"{np.dtype(dtype).name} tokens ({num_tokens * np.dtype(dtype).itemsize:,} bytes): the shard is "
                "truncated or its index belongs to another file; tokenize the corpus again"
            )
        return ShardIndex(np.dtype(dtype), num_sequences, num_indices - 1, num_tokens)


class IndexedShardWriter:
    """Writes one shard document by document, streaming the tokens to `PREFIX.bin.tmp` (memory: the index only) and
    checksumming them as they go; `finish()` writes the index and renames both files into place."""

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self.bin_path, self.idx_path = _paths(self.prefix)
        self._bin = open(f"{self.bin_path}.tmp", "wb")  # noqa: SIM115  (closed in finish)
        self._lengths = array("i")
        self._chunk_crcs: list[int] = []
        self._chunk_fill = 0
        self._running_crc = 0
        self._document_length = 0
        self.max_token_id = -1

    def append(self, token_ids: list[int] | np.ndarray) -> None:
        """Tokens of the document being written (`end_document` closes it)."""
        ids = np.asarray(token_ids)
        if not ids.size:
            return
        if ids.min() < 0 or ids.max() > max_token_id(self.dtype):
            raise DatasetError(f"token id {int(ids.max())} does not fit the shard's {self.dtype.name} tokens")
        data = ids.astype(self.dtype, copy=False).tobytes()
        self._bin.write(data)
        self._checksum(data)
        self._document_length += ids.size
        self.max_token_id = max(self.max_token_id, int(ids.max()))

    def append_documents(self, documents: list[np.ndarray]) -> None:
        """Whole documents at once (the open one ended first): one range check and one write for a batch."""
        if self._document_length:
            raise RuntimeError("end_document() the open document before appending whole ones")
        if documents:
            self.append(np.concatenate(documents))
        self._document_length = 0
        self._lengths.extend(len(document) for document in documents)

    def end_document(self) -> None:
        self._lengths.append(self._document_length)
        self._document_length = 0

    def finish(self) -> dict:
        """Close the files; returns the shard's manifest entry (sizes, checksums)."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(lengths.size, np.int64)
        np.cumsum(lengths[:-1], out=pointers[1:])
        pointers *= self.dtype.itemsize
        document_indices = np.arange(lengths.size + 1, dtype=np.int64)
        counts = (lengths.size, lengths.size + 1)  # sequences, document entries: one sequence a document
        header = INDEX_HEADER + struct.pack("<QBQQ", INDEX_VERSION, _CODE_OF[self.dtype], *counts)
        index_bytes = header + lengths.tobytes() + pointers.tobytes() + document_indices.tobytes()
        Path(f"{self.idx_path}.tmp").write_bytes(index_bytes)
        Path(f"{self.bin_path}.tmp").replace(self.bin_path)
        Path(f"{self.idx_path}.tmp").replace(self.idx_path)
        if self._chunk_fill:
            self._chunk_crcs.append(self._running_crc)
        return {
            "num_tokens": int(lengths.sum(dtype=np.int64)),
            "num_documents": int(lengths.size),
            "max_token_id": self.max_token_id,
            "idx_crc32": zlib.crc32(index_bytes),
            "chunk_crc32": self._chunk_crcs,
        }

    def _checksum(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._chunk_fill == 0:
                self._running_crc = 0
            take = min(len(view), CHUNK_BYTES - self._chunk_fill)
            self._running_crc = zlib.crc32(view[:take], self._running_crc)
            self._chunk_fill += take
            view = view[take:]
            if self._chunk_fill == CHUNK_BYTES:
                self._chunk_crcs.append(self._running_crc)
                self._chunk_fill = 0


def file_crc32(path: Path, start: int = 0, length: int | None = None, block: int = 8 << 20) -> int:
    """CRC-32 of `length` bytes of `path` from `start` (all of the rest for None), read in blocks: memory stays at one
    block and no page of the file is mapped into the process."""
    crc, remaining = 0, length
    with open(path, "rb") as f:
        f.seek(start)
        while remaining is None or remaining > 0:
            data = f.read(block if remaining is None else min(block, remaining))
            if not data:
                break
            crc = zlib.crc32(data, crc)
            if remaining is not None:
                remaining -= len(data)
    return crc


def shard_prefix(path: str | Path) -> Path:
    """`PREFIX`, `PREFIX.bin` or `PREFIX.idx` -> PREFIX."""
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".bin", ".idx") else path


def is_indexed_prefix(path: str | Path) -> bool:
    bin_path, idx_path = _paths(shard_prefix(path))
    return idx_path.is_file() or bin_path.is_file()


def _contains(sorted_values: np.ndarray, value: int) -> bool:
    at = bisect.bisect_left(sorted_values, value)
    return at < sorted_values.size and sorted_values[at] == value


def _paths(prefix: Path) -> tuple[Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def _map(path: Path) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
