"""Sources opened for training: shard folders checked against their manifest, Megatron files, the raw-corpus size
limit, blends (shares, resume, per-source counts) and document ids from the index."""

import itertools
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from scripts import tokenize_corpus
from torchtitan.datasets.corpus import DatasetError
from torchtitan.datasets.dataloader import build_dataloader
from torchtitan.datasets.indexed import IndexedShardWriter
from torchtitan.datasets.shards import check_sources, open_source
from torchtitan.datasets.text_datasets import SplitLayout, build_text_dataset

VOCAB = 2048
TOKENIZER = Path(__file__).resolve().parents[3] / "torchtitan/assets/tokenizer/tokenizer.json"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The shipped corpus tokenized into 4 shards by scripts/tokenize_corpus.py (its .jsonl cut in byte ranges)."""
    from torchtitan.datasets.corpus import TINYCORPUS_PATH, read_documents

    folder = tmp_path_factory.mktemp("shards")
    documents = read_documents(TINYCORPUS_PATH)
    (folder / "austen.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    part_mib = (folder / "austen.jsonl").stat().st_size / 4 / 2**20
    args = [str(folder / "austen.jsonl"), "--out", str(folder / "out"), "--tokenizer", str(TOKENIZER)]
    assert tokenize_corpus.main([*args, "--part-mib", str(part_mib)]) == 0
    return folder / "out"


def copy_of(shards: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(shards, tmp_path / "copy"))


def megatron_files(folder: Path, documents: list[list[int]], dtype=np.uint16) -> Path:
    """Documents without BOS / EOS, as Megatron's preprocess_data.py writes them (IndexedShardWriter writes Megatron's
    layout; tests/unit/datasets/test_indexed.py checks it against Megatron's own builder)."""
    folder.mkdir(exist_ok=True)
    writer = IndexedShardWriter(folder / "corpus_text_document", dtype)
    for doc in documents:
        writer.append(doc)
        writer.end_document()
    writer.finish()
    return folder / "corpus_text_document"


def windows(job_config, tokenizer, rank=0, ranks=1, n=3):
    loader = build_dataloader(job_config, tokenizer, VOCAB, rank, ranks)
    return [(x["input"], x["document_ids"], y) for x, y in itertools.islice(loader, n)]


def test_shards_train_the_same_samples_as_the_raw_corpus(shards, tokenizer, make_job_config):
    """The shipped corpus through shards written by the tokenize script = the same corpus tokenized on the fly."""
    from_shards = windows(make_job_config(shards, seq_len=64, local_batch_size=4), tokenizer, n=6)
    from_raw = windows(make_job_config(None, seq_len=64, local_batch_size=4), tokenizer, n=6)
    for a, b in zip(from_shards, from_raw, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "shard-000002.bin").unlink(), r"shard-000002\.bin is missing"),
        (
            lambda f: (f / "shard-000001.bin").write_bytes(b"\0" * 10),
            r"shard-000001\.bin is 10 bytes, but .* truncated",
        ),
        (
            lambda f: (f / "shard-000003.idx").write_bytes((f / "shard-000000.idx").read_bytes()),
            r"shard-000003\.bin is [0-9,]+ bytes, but shard-000003\.idx indexes .* belongs to another file",
        ),
        (lambda f: (f / "manifest.json").write_text("{"), r"manifest\.json is not readable JSON"),
    ],
)
def test_a_damaged_shard_folder_is_one_line_in_preflight(shards, tmp_path, make_job_config, damage, message):
    folder = copy_of(shards, tmp_path)
    damage(folder)
    with pytest.raises(DatasetError, match=message) as err:
        check_sources(make_job_config(folder))
    assert "\n" not in str(err.value) and "tokenize" in str(err.value)


def test_an_index_checksum_mismatch_fails_the_rank_that_reads_it(shards, tmp_path, tokenizer, make_job_config):
    folder = copy_of(shards, tmp_path)
    index = folder / "shard-000000.idx"
    raw = bytearray(index.read_bytes())
    raw[40] ^= 1  # inside the sequence lengths: the header and sizes still agree
    index.write_bytes(bytes(raw))
    check_sources(make_job_config(folder))  # opening reads no whole index: a terabyte corpus opens as fast
    with pytest.raises(DatasetError, match=r"shard-000000\.idx: checksum mismatch against the manifest"):
        windows(make_job_config(folder), tokenizer)


def test_a_damaged_token_chunk_fails_the_rank_that_reads_it(shards, tmp_path, tokenizer, make_job_config):
    folder = copy_of(shards, tmp_path)
    token_file = folder / "shard-000000.bin"
    raw = bytearray(token_file.read_bytes())
    raw[0] ^= 1
    token_file.write_bytes(bytes(raw))
    check_sources(make_job_config(folder))  # sizes and index are intact
    with pytest.raises(DatasetError, match=r"shard-000000\.bin: checksum mismatch in bytes 0-"):
        windows(make_job_config(folder), tokenizer)


def test_shards_of_another_tokenizer_or_a_smaller_vocabulary_are_refused(shards, tokenizer, tmp_path):
    folder = copy_of(shards, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"] = "0123456789abcdef"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match="tokenized with another tokenizer .* pass that --model.tokenizer_path"):
        open_source(str(folder), "", tokenizer, VOCAB, "training")
    with pytest.raises(DatasetError, match=r"holds token id \d+, past the model's vocabulary of 1,000"):
        open_source(str(shards), "", tokenizer, 1000, "training")


def test_megatron_files_train_with_documents_from_their_index(tmp_path, tokenizer, make_job_config):
    """No BOS in Megatron's files: the document ids come from the index, not from scanning for BOS."""
    documents = [list(range(10, 10 + n)) for n in (5, 9, 3, 7)]
    prefix = megatron_files(tmp_path / "mega", documents)
    for path in (prefix, f"{prefix}.bin", tmp_path / "mega"):  # the prefix, a file of the pair, or their folder
        [(tokens, document_ids, labels)] = windows(
            make_job_config(path, seq_len=11, local_batch_size=1), tokenizer, n=1
        )
        assert tokens[0].tolist() == [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 15]
        assert document_ids[0].tolist() == [1] * 5 + [2] * 7  # the window's 12 tokens: two documents
    check_sources(make_job_config(prefix))


def test_megatron_ids_past_the_vocabulary_and_too_small_a_dtype_are_refused(tmp_path, tokenizer, make_job_config):
    prefix = megatron_files(tmp_path / "big", [[1, 2, 3000, 4] * 20])
    with pytest.raises(DatasetError, match=r"corpus_text_document\.bin holds token id 3000 .* past the model's vocab"):
        windows(make_job_config(prefix, seq_len=8, local_batch_size=1), tokenizer)
    small = megatron_files(tmp_path / "u8", [[1, 2, 3] * 20], dtype=np.uint8)
    with pytest.raises(
        DatasetError, match=r"stores uint8 tokens \(ids up to 255\), too small for the tokenizer's .* 2,048"
    ):
        open_source(str(small), "", tokenizer, VOCAB, "training")


def test_a_model_vocabulary_past_the_shards_dtype_is_fine(shards, tokenizer, make_job_config):
    """The 16B's 102,400 ids with the shipped 2,048-id tokenizer: uint16 shards hold every id the tokenizer writes."""
    source = open_source(str(shards), "", tokenizer, 102_400, "training")
    assert source.shards[0].index.dtype == np.uint16
    assert open_source(None, "tinycorpus", tokenizer, 102_400, "training").num_documents == 269


def test_a_raw_corpus_past_the_limit_is_refused_naming_the_tokenize_command(tmp_path, make_job_config, monkeypatch):
    monkeypatch.setattr("torchtitan.datasets.shards.RAW_CORPUS_LIMIT", 1000)
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": "x" * 2000}) + "\n")
    with pytest.raises(DatasetError, match=r"raw text, more than .* `python scripts/tokenize_corpus.py .*big\.jsonl"):
        check_sources(make_job_config(tmp_path / "big.jsonl"))


def blend_config(make_job_config, entries, **kwargs):
    job_config = make_job_config(**kwargs)
    job_config.training.dataset_blend = entries
    return job_config


def test_a_blend_realizes_its_weights_within_1_percent_and_counts_tokens_per_source(
    shards, tmp_path, tokenizer, make_job_config
):
    prefix = megatron_files(tmp_path / "mega", [list(range(5, 5 + n)) for n in (40, 70, 30)])
    # the same folder twice is two sources
    job_config = blend_config(make_job_config, [f"0.7:{shards}", f"0.2:{prefix}", f"0.1:{shards}"], seq_len=8)
    dataset, identity = build_text_dataset(job_config, tokenizer, VOCAB, SplitLayout.of(job_config, 0, 1))
    sources = [dataset.mixture.locate(i)[0] for i in range(10_000)]
    shares = np.bincount(sources, minlength=3) / len(sources)
    assert np.abs(shares - [0.7, 0.2, 0.1]).max() < 0.01
    for start in (0, 3_333, 123_457):  # any 10k samples, not only the first
        window = np.bincount([dataset.mixture.locate(i)[0] for i in range(start, start + 10_000)], minlength=3)
        assert np.abs(window / 10_000 - [0.7, 0.2, 0.1]).max() < 0.01
    counts = dataset.tokens_per_source(10_000)
    assert list(counts) == ["out", "corpus_text_document", "out_2"]  # short names for the metrics, made unique
    assert sum(counts.values()) == 10_000 * 8 and counts["corpus_text_document"] == np.sum(np.array(sources) == 1) * 8
    assert identity["dataset"] == [str(shards), str(prefix), str(shards)]
    # sample i of the blend is sample j of its source
    source, within = dataset.mixture.locate(5)
    tokens, _ = dataset.mixture.sample(5)
    assert np.array_equal(tokens, dataset.mixture.streams[source].window(within * 9, 9)[0])


def test_a_blend_resumes_exactly_and_at_another_data_parallel_degree(shards, tmp_path, tokenizer, make_job_config):
    prefix = megatron_files(tmp_path / "mega", [list(range(5, 5 + n)) for n in (40, 70, 30)])
    entries = [f"3:{shards}", f"1:{prefix}"]
    saved = build_dataloader(blend_config(make_job_config, entries, local_batch_size=2), tokenizer, VOCAB, 1, 2)
    iterator = iter(saved)
    list(itertools.islice(iterator, 3))
    state = pickle.loads(pickle.dumps(saved.state_dict()))
    expected = list(itertools.islice(iterator, 2))
    resumed = build_dataloader(blend_config(make_job_config, entries, local_batch_size=2), tokenizer, VOCAB, 1, 2)
    resumed.load_state_dict(state)
    for (x, y), (a, b) in zip(itertools.islice(resumed, 2), expected, strict=True):
        assert torch.equal(x["input"], a["input"]) and torch.equal(y, b)
    # one rank of batch 4 continues where the two ranks stopped: steps 4-5 of both ranks, concatenated
    single = build_dataloader(blend_config(make_job_config, entries, local_batch_size=4), tokenizer, VOCAB, 0, 1)
    single.load_state_dict(state)
    rank0 = build_dataloader(blend_config(make_job_config, entries, local_batch_size=2), tokenizer, VOCAB, 0, 2)
    rank0 = list(itertools.islice(rank0, 5))[3:]
    for (x, _), (a, _), (b, _) in zip(itertools.islice(single, 2), rank0, expected, strict=True):
        assert torch.equal(x["input"], torch.cat([a["input"], b["input"]]))
    # a changed blend is a different data stream: refused on resume
    other = build_dataloader(blend_config(make_job_config, [f"1:{shards}", f"1:{prefix}"]), tokenizer, VOCAB, 1, 2)
    with pytest.raises(ValueError, match="data_sha256"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    "entries, message",
    [
        (["-1:/data/a", "1:/data/b"], "the weight must be a number >= 0"),
        (["0:/data/a", "0:/data/b"], "weights are all zero"),
        (["/data/a"], "is not WEIGHT:PATH"),
        (["x:/data/a"], "is not WEIGHT:PATH"),
    ],
)
def test_bad_blend_weights_are_one_line(make_job_config, entries, message):
    with pytest.raises(DatasetError, match=message):
        check_sources(blend_config(make_job_config, entries))


def test_a_blend_and_a_dataset_path_together_are_refused(shards, make_job_config):
    job_config = blend_config(make_job_config, [f"1:{shards}"], dataset_path=shards)
    with pytest.raises(DatasetError, match="dataset_path and --training.dataset_blend are both set"):
        check_sources(job_config)
