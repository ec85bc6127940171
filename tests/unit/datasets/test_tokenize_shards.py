"""scripts/tokenize_corpus.py and the shard writer behind it: parts, workers, resume after a kill, join, verify."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scripts import tokenize_corpus
from torchtitan.datasets.corpus import DatasetError
from torchtitan.datasets.document_encoder import DocumentEncoder
from torchtitan.datasets.indexed import IndexedShard
from torchtitan.datasets.shards import read_manifest
from torchtitan.datasets.tokenize_shards import plan_parts, tokenize_part, tokenize_parts

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[3] / "torchtitan/assets/tokenizer/tokenizer.json"


def document_lengths(shard: IndexedShard) -> np.ndarray:
    return np.diff([*shard.document_starts(0, shard.num_tokens), shard.num_tokens])


def corpus(folder, documents: int = 60):
    """A .jsonl, a Parquet file of several row groups and a .txt file; their documents in reading order."""
    folder.mkdir()
    texts = [f"Document {i}: " + "Emma was handsome, clever and rich. " * (1 + i % 5) for i in range(documents)]
    half = documents // 2
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:half]))
    pq.write_table(pa.table({"text": texts[half:]}), folder / "b.parquet", row_group_size=7)
    book = "Chapter 1\n\n" + "It is a truth universally acknowledged.\n" * 40
    (folder / "c.txt").write_text(book)
    return texts + [book]


def shard_stream(folder) -> tuple[list[int], list[int]]:
    """(all tokens of a shard folder in manifest order, each document's length)."""
    shards = [IndexedShard(folder / entry["name"]) for entry in read_manifest(folder)["shards"]]
    tokens = [t for shard in shards for t in shard.tokens(0, shard.num_tokens).tolist()]
    return tokens, [int(n) for shard in shards for n in document_lengths(shard)]


def expected_stream(tokenizer, documents) -> tuple[list[int], list[int]]:
    encoded = tokenizer.encode_batch(documents, add_bos=True, add_eos=True)
    return [t for ids in encoded for t in ids], [len(ids) for ids in encoded]


def run_script(*args: str) -> int:
    return tokenize_corpus.main([*map(str, args), "--tokenizer", str(SHIPPED_TOKENIZER)])


def test_parts_of_large_files_give_the_stream_of_the_whole_files(tmp_path, tokenizer, capsys):
    documents = corpus(tmp_path / "src")
    files = sorted((tmp_path / "src").iterdir())
    parts = plan_parts(files, part_bytes=500)  # byte ranges of the .jsonl, runs of row groups of the .parquet
    assert len([p for p in parts if p.path.endswith(".jsonl")]) > 3 and len(parts) > 8
    assert run_script(tmp_path / "src", "--out", tmp_path / "out", "--part-mib", 500 / 2**20) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parts"] == len(parts) and report["tokenized_now"] == len(parts)
    assert shard_stream(tmp_path / "out") == expected_stream(tokenizer, documents)
    manifest = read_manifest(tmp_path / "out")
    assert manifest["num_documents"] == len(documents) and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["fingerprint"] == tokenizer.fingerprint


def test_worker_processes_write_the_same_shards(tmp_path):
    corpus(tmp_path / "src")
    assert run_script(tmp_path / "src", "--out", tmp_path / "one", "--part-mib", 2000 / 2**20) == 0
    assert run_script(tmp_path / "src", "--out", tmp_path / "two", "--part-mib", 2000 / 2**20, "--workers", 2) == 0
    assert shard_stream(tmp_path / "two") == shard_stream(tmp_path / "one")
    assert read_manifest(tmp_path / "two")["shards"] == read_manifest(tmp_path / "one")["shards"]


def test_a_killed_run_resumes_keeping_checked_shards_and_redoing_the_rest(tmp_path, tokenizer, monkeypatch):
    documents = corpus(tmp_path / "src")
    parts = plan_parts(sorted((tmp_path / "src").iterdir()), part_bytes=1000)
    out = tmp_path / "out"
    killed_at = 3
    original = tokenize_part

    def dies_at_part(tok, part, folder, index):
        if index == killed_at:  # the kill: a half-written shard, no marker
            (folder / f"shard-{index:06d}.bin.tmp").write_bytes(b"\x00" * 10)
            raise KeyboardInterrupt
        return original(tok, part, folder, index)

    monkeypatch.setattr("torchtitan.datasets.tokenize_shards.tokenize_part", dies_at_part)
    with pytest.raises(KeyboardInterrupt):
        tokenize_parts(parts, out, SHIPPED_TOKENIZER)
    monkeypatch.undo()
    assert not (out / "manifest.json").exists()  # never taken as complete
    # a finished shard damaged after the kill is redone, the intact ones are kept
    damaged = out / "shard-000001.bin"
    damaged.write_bytes(damaged.read_bytes()[:-2] + b"\xff\xff")
    done = tokenize_parts(parts, out, SHIPPED_TOKENIZER)
    assert done["parts"] == len(parts) - 2  # all but shards 0 and 2
    assert run_script(tmp_path / "src", "--out", out, "--part-mib", 1000 / 2**20) == 0
    assert shard_stream(out) == expected_stream(tokenizer, documents)


def test_parts_of_a_job_array_then_one_join(tmp_path, tokenizer, capsys):
    documents = corpus(tmp_path / "src")
    common = (tmp_path / "src", "--out", tmp_path / "out", "--part-mib", 1000 / 2**20)
    assert run_script(*common, "--part", "1/3") == 0
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert run_script(*common, "--join") == 2
    assert "parts are not tokenized yet" in capsys.readouterr().err
    assert run_script(*common, "--part", "0/3") == 0 and run_script(*common, "--part", "2/3") == 0
    assert run_script(*common, "--join") == 0
    assert shard_stream(tmp_path / "out") == expected_stream(tokenizer, documents)
    assert run_script(*common, "--part", "3/3") == 2 and "--part '3/3' is not I/N" in capsys.readouterr().err


def test_verify_reads_every_byte_against_the_manifest(tmp_path, capsys):
    corpus(tmp_path / "src")
    assert run_script(tmp_path / "src", "--out", tmp_path / "out") == 0
    assert tokenize_corpus.main(["--verify", str(tmp_path / "out")]) == 0
    shard = tmp_path / "out" / "shard-000001.bin"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 1
    shard.write_bytes(bytes(raw))
    capsys.readouterr()
    assert tokenize_corpus.main(["--verify", str(tmp_path / "out")]) == 1
    assert "shard-000001.bin: checksum mismatch in chunk 0" in capsys.readouterr().out


def test_a_large_txt_document_is_encoded_in_pieces_cut_at_line_ends(tmp_path, tokenizer, monkeypatch):
    text = "".join(f"Line {i} of the book, with words.\n" for i in range(400))
    (tmp_path / "book.txt").write_text(text)
    monkeypatch.setattr("torchtitan.datasets.corpus.iter_text_pieces.__defaults__", (1000,))
    [part] = plan_parts([tmp_path / "book.txt"])
    tokenize_part(DocumentEncoder(tokenizer), part, tmp_path, 0)
    shard = IndexedShard(tmp_path / "shard-000000")
    assert shard.tokens(0, shard.num_tokens).tolist() == tokenizer.encode(text, add_bos=True, add_eos=True)


def test_bad_arguments_are_one_line(tmp_path, capsys):
    assert run_script(tmp_path / "missing.jsonl", "--out", tmp_path / "out") == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(DatasetError, match="not a token-shard manifest|not readable JSON"):
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "manifest.json").write_text("[]")
        read_manifest(tmp_path / "m")
