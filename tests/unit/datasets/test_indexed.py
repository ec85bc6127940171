"""Megatron-LM's indexed dataset: files of Megatron's own builder read here, ours read by Megatron, damaged ones
refused in one line."""

import struct

import numpy as np
import pytest

from torchtitan.datasets.corpus import DatasetError
from torchtitan.datasets.indexed import IndexedShard, IndexedShardWriter, token_dtype

DOCUMENTS = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]


@pytest.fixture(scope="module")
def megatron_files(tmp_path_factory):
    """(folder of Megatron-written files, what Megatron read of ours: its sequences and document index). Megatron-core
    (a dev dependency) writes a file of each kind with its builder, and reads the file we wrote, in this process:
    `importorskip` has imported it already (seconds; a subprocess would import torch and it once more)."""
    pytest.importorskip("megatron.core", reason="megatron-core is a dev dependency (pip install -e '.[dev]')")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    folder = tmp_path_factory.mktemp("megatron")
    write_ours(folder / "ours", DOCUMENTS)
    for dtype, sentences in (("uint16", False), ("int32", False), ("uint16", True)):
        prefix = f"{folder}/{dtype}_{int(sentences)}"
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=getattr(np, dtype))
        for doc in DOCUMENTS:
            if sentences and len(doc) > 1:  # a document of two sequences (sentence splitting)
                builder.add_document(np.array(doc), [1, len(doc) - 1])
            else:
                builder.add_document(np.array(doc), [len(doc)])
        builder.finalize(prefix + ".idx")
    ours = IndexedDataset(f"{folder}/ours")
    read = [ours[i].tolist() for i in range(len(ours))], ours.document_indices.tolist()
    del ours  # its memory maps
    return folder, read


def document_lengths(shard: IndexedShard) -> np.ndarray:
    return np.diff([*shard.document_starts(0, shard.num_tokens), shard.num_tokens])


def write_ours(prefix, documents, dtype=np.uint16) -> dict:
    writer = IndexedShardWriter(prefix, dtype)
    for doc in documents:
        writer.append(doc)
        writer.end_document()
    return writer.finish()


@pytest.mark.parametrize("dtype, sentences", [("uint16", False), ("int32", False), ("uint16", True)])
def test_files_of_megatrons_builder_read_with_their_documents(megatron_files, dtype, sentences):
    shard = IndexedShard(megatron_files[0] / f"{dtype}_{int(sentences)}.idx")  # a prefix, .idx or .bin names the pair
    assert shard.index.dtype == np.dtype(dtype) and shard.index.num_documents == len(DOCUMENTS)
    stream = [t for doc in DOCUMENTS for t in doc]
    assert shard.tokens(0, shard.num_tokens).tolist() == stream
    assert shard.tokens(2, 5).tolist() == stream[2:5] and shard.tokens(2, 5).dtype == np.int64
    starts = np.cumsum([0] + [len(d) for d in DOCUMENTS[:-1]])
    # documents begin where Megatron's document index says, not at every sequence (sentence) it split them into
    assert shard.document_starts(0, shard.num_tokens).tolist() == starts.tolist()
    assert shard.document_starts(1, 5).tolist() == [3, 4]
    assert document_lengths(shard).tolist() == [len(d) for d in DOCUMENTS]


def test_megatron_reads_the_shards_we_write(megatron_files):
    sequences, document_indices = megatron_files[1]
    assert sequences == DOCUMENTS and document_indices == [0, 1, 2, 3, 4]


def test_token_dtype_is_the_smallest_the_format_holds():
    assert [token_dtype(v).name for v in (256, 257, 65536, 65537, 129280)] == [
        "uint8",
        "uint16",
        "uint16",
        "int32",
        "int32",
    ]


def test_writer_checksums_chunks_and_refuses_ids_past_its_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr("torchtitan.datasets.indexed.CHUNK_BYTES", 4)
    entry = write_ours(tmp_path / "s", DOCUMENTS)
    assert entry["num_tokens"] == 10 and entry["num_documents"] == 4 and entry["max_token_id"] == 14
    assert len(entry["chunk_crc32"]) == 5  # 20 bytes of uint16 tokens in chunks of 4
    writer = IndexedShardWriter(tmp_path / "u8", np.uint8)
    with pytest.raises(DatasetError, match="token id 300 does not fit the shard's uint8 tokens"):
        writer.append([1, 300])


def test_a_truncated_shard_is_one_error_naming_it(tmp_path):
    write_ours(tmp_path / "s", DOCUMENTS)
    bin_path = tmp_path / "s.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(DatasetError, match=r"s\.bin is 18 bytes, but s\.idx indexes 10 uint16 tokens .* truncated"):
        IndexedShard(tmp_path / "s")


def test_an_index_that_does_not_match_its_tokens_is_one_error(tmp_path):
    write_ours(tmp_path / "a", DOCUMENTS)
    write_ours(tmp_path / "b", DOCUMENTS[:2])
    (tmp_path / "a.idx").write_bytes((tmp_path / "b.idx").read_bytes())  # another shard's index
    with pytest.raises(DatasetError, match="its index belongs to another file"):
        IndexedShard(tmp_path / "a")
    idx = tmp_path / "b.idx"
    idx.write_bytes(idx.read_bytes()[:-8])
    with pytest.raises(DatasetError, match=r"b\.idx is \d+ bytes, but its header describes .* truncated or damaged"):
        IndexedShard(tmp_path / "b")


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda raw: raw[:9] + struct.pack("<Q", 2) + raw[17:], "indexed-dataset version 2; this reader knows"),
        (lambda raw: b"NOTANIDX\x00" + raw[9:], "not a Megatron indexed-dataset index"),
        (lambda raw: raw[:17] + bytes([7]) + raw[18:], "dtype code 7, not integer token ids"),
    ],
)
def test_an_index_of_unknown_version_header_or_dtype_is_one_error(tmp_path, damage, message):
    write_ours(tmp_path / "s", DOCUMENTS)
    idx = tmp_path / "s.idx"
    idx.write_bytes(damage(idx.read_bytes()))
    with pytest.raises(DatasetError, match=message):
        IndexedShard(tmp_path / "s")


def test_a_missing_shard_file_is_one_error(tmp_path):
    write_ours(tmp_path / "s", DOCUMENTS)
    (tmp_path / "s.bin").unlink()
    with pytest.raises(DatasetError, match=r"s\.bin is missing; restore it or tokenize"):
        IndexedShard(tmp_path / "s")


def test_a_damaged_chunk_fails_when_first_read(tmp_path, monkeypatch):
    monkeypatch.setattr("torchtitan.datasets.indexed.CHUNK_BYTES", 4)
    entry = write_ours(tmp_path / "s", DOCUMENTS)
    raw = bytearray((tmp_path / "s.bin").read_bytes())
    raw[13] ^= 1  # token 6, in chunk 3
    (tmp_path / "s.bin").write_bytes(bytes(raw))
    shard = IndexedShard(tmp_path / "s", entry["chunk_crc32"])
    assert shard.tokens(0, 6).tolist() == [5, 6, 7, 8, 9, 10]  # chunks 0-2 are intact
    with pytest.raises(DatasetError, match=r"s\.bin: checksum mismatch in bytes 12-16 .* tokenize the corpus again"):
        shard.tokens(6, 7)


def test_a_shard_pickles_as_its_paths_and_releases_its_pages(tmp_path):
    import pickle

    write_ours(tmp_path / "s", DOCUMENTS)
    shard = IndexedShard(tmp_path / "s")
    shard.tokens(0, 3)
    copy = pickle.loads(pickle.dumps(shard))
    assert copy.tokens(0, 10).tolist() == shard.tokens(0, 10).tolist()
    shard.release()  # pages dropped, data still readable
    assert shard.tokens(3, 4).tolist() == [8]
