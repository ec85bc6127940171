import gzip
import itertools
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torchtitan.datasets.corpus import (
    CACHE_DIR_ENV,
    DatasetError,
    check_corpus,
    describe_corpus,
    read_documents,
    resolve_corpus_files,
)
from torchtitan.datasets.shards import open_source
from torchtitan.datasets.text_datasets import PackedTextDataset, SplitLayout, build_text_dataset

VOCAB = 2048  # the shipped tokenizer's, the debug model's


def read_corpus(path) -> list[str]:
    return [doc for f in resolve_corpus_files("ignored", str(path)) for doc in read_documents(f)]


def stream_of(dataset: PackedTextDataset) -> list[int]:
    """The whole token stream of a one-source dataset."""
    stream = dataset.mixture.streams[0]
    return stream.window(0, stream.num_tokens)[0].tolist()


def tokenize_corpus(files, tokenizer) -> tuple[torch.Tensor, int]:
    """(the token stream of a raw corpus file, its number of documents), through the trainer's cached shards."""
    source = open_source(str(files[0]), "", tokenizer, VOCAB, "training")
    stream = source.stream()
    return torch.from_numpy(stream.window(0, stream.num_tokens)[0]), source.num_documents


def text_dataset(job_config, tokenizer, dp_rank: int, dp_world_size: int, split: str = "train"):
    """`build_text_dataset` for rank `dp_rank` of `dp_world_size` (as the data loader calls it)."""
    return build_text_dataset(job_config, tokenizer, VOCAB, SplitLayout.of(job_config, dp_rank, dp_world_size, split))


def take(dataset: PackedTextDataset, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x["input"], y) for x, y in itertools.islice(iter(dataset), n)]


# ---- packing ----


def test_token_stream_is_bos_doc_eos_per_document(tokenizer, jsonl_corpus, documents):
    stream, num_documents = tokenize_corpus([jsonl_corpus], tokenizer)
    expected = [t for doc in documents for t in tokenizer.encode(doc, add_bos=True, add_eos=True)]
    assert num_documents == len(documents)
    assert stream.dtype == torch.int64 and stream.tolist() == expected


def test_tokenized_corpus_is_cached_on_disk_for_later_processes(tokenizer, jsonl_corpus, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    stream, num_documents = tokenize_corpus([jsonl_corpus], tokenizer)
    [cached] = (tmp_path / "cache" / "shards").iterdir()
    assert (cached / "manifest.json").is_file() and (cached / "shard-000000.bin").is_file()

    # the next call maps the shards and tokenizes nothing
    with monkeypatch.context() as patch:
        patch.setattr("torchtitan.datasets.shards.tokenize_parts", lambda *a, **k: pytest.fail("tokenized again"))
        again, again_documents = tokenize_corpus([jsonl_corpus], tokenizer)
    assert torch.equal(again, stream) and again_documents == num_documents

    # A damaged cache (a truncated shard) is rebuilt, with a warning, not an error.
    tokens = cached / "shard-000000.bin"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with caplog.at_level("WARNING"):
        rebuilt, _ = tokenize_corpus([jsonl_corpus], tokenizer)
    assert torch.equal(rebuilt, stream) and "ignoring the damaged tokenized-corpus cache" in caplog.text

    # An edited corpus (new size or mtime) is tokenized again.
    jsonl_corpus.write_text(json.dumps({"text": "one new document"}) + "\n")
    edited, edited_documents = tokenize_corpus([jsonl_corpus], tokenizer)
    assert edited_documents == 1 and edited.tolist() == tokenizer.encode("one new document", add_bos=True, add_eos=True)


def test_samples_are_shifted_windows_of_the_stream_spanning_documents(tokenizer, jsonl_corpus, make_job_config):
    seq_len = 16
    dataset, _ = text_dataset(make_job_config(jsonl_corpus, seq_len=seq_len), tokenizer, 0, 1)
    stream = stream_of(dataset)
    assert len(stream) > 3 * (seq_len + 1)
    samples = take(dataset, 3)
    for i, (inputs, labels) in enumerate(samples):
        window = stream[i * (seq_len + 1) : (i + 1) * (seq_len + 1)]
        assert inputs.shape == labels.shape == (seq_len,)
        assert inputs.tolist() == window[:-1] and labels.tolist() == window[1:]
    # The first sample begins a document; later ones start mid-document and cross EOS -> BOS boundaries.
    assert samples[0][0][0] == tokenizer.bos_id
    boundary = [tokenizer.eos_id, tokenizer.bos_id]
    assert any(x.tolist()[j : j + 2] == boundary for x, _ in samples[1:] for j in range(1, seq_len - 1))
    # No padding: consecutive samples tile the stream exactly.
    flat = torch.cat([torch.cat([x, y[-1:]]) for x, y in samples]).tolist()
    assert flat == stream[: len(flat)]


def test_a_corpus_smaller_than_one_step_is_a_warning_naming_the_flag(tmp_path, tokenizer, make_job_config, caplog):
    (tmp_path / "tiny.txt").write_text("hi")
    with caplog.at_level("WARNING"):
        text_dataset(make_job_config(tmp_path / "tiny.txt", seq_len=16), tokenizer, 0, 1)
    assert "fewer than one step reads from it (34)" in caplog.text and "--training.dataset_path" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        text_dataset(make_job_config(seq_len=16), tokenizer, 0, 1)  # the shipped corpus: no warning
    assert "fewer than one step" not in caplog.text


def test_stream_repeats_over_epochs(tokenizer, jsonl_corpus, make_job_config):
    seq_len = 7
    dataset, _ = text_dataset(make_job_config(jsonl_corpus, seq_len=seq_len), tokenizer, 0, 1)
    stream = stream_of(dataset)
    samples_per_epoch = len(stream) // (seq_len + 1) + 2
    samples = take(dataset, 2 * samples_per_epoch)
    flat = [t for x, y in samples for t in [*x.tolist(), y[-1].item()]]
    assert flat == (stream * 3)[: len(flat)]
    assert dataset.state_dict() == {"samples_yielded": len(samples)} and len(flat) // len(stream) >= 2


def test_dataset_state_round_trip_resumes_exactly(tokenizer, jsonl_corpus, make_job_config):
    job_config = make_job_config(jsonl_corpus)
    first, _ = text_dataset(job_config, tokenizer, 1, 3)
    take(first, 5)
    second, _ = text_dataset(job_config, tokenizer, 1, 3)
    second.load_state_dict(first.state_dict())
    for (a, b), (c, d) in zip(take(first, 4), take(second, 4), strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)


# ---- sources and formats ----


def test_tinycorpus_is_the_shipped_austen_chapters():
    files = resolve_corpus_files("tinycorpus", None)
    documents = read_documents(files[0])
    assert len(documents) == 269
    assert documents[0].startswith("CHAPTER 1\n\nThe family of Dashwood")


def test_jsonl_and_jsonl_gz(tmp_path, documents):
    lines = "".join(json.dumps({"text": doc}) + "\n" for doc in documents)
    (tmp_path / "a.jsonl").write_text(lines + "\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(lines)
    assert read_corpus(tmp_path / "a.jsonl") == documents
    assert read_corpus(tmp_path / "b.jsonl.gz") == documents


def test_jsonl_without_text_field_is_an_error(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"content": "x"}\n')
    # the fix named: the field it has, and how to give it the one it needs
    fix = r"a\.jsonl:1: JSON object has no 'text' field \(its fields: content\); .*rename"
    with pytest.raises(ValueError, match=fix):
        read_corpus(tmp_path / "a.jsonl")


def test_txt_file_is_one_document(tmp_path):
    text = "Chapter 1\n\nFirst paragraph.\n\nSecond paragraph.\n"
    (tmp_path / "book.txt").write_text(text)
    with gzip.open(tmp_path / "book2.txt.gz", "wt") as f:
        f.write(text)
    assert read_corpus(tmp_path / "book.txt") == [text]
    assert read_corpus(tmp_path / "book2.txt.gz") == [text]


def test_parquet_text_column(tmp_path, documents):
    pq.write_table(pa.table({"id": list(range(len(documents))), "text": documents}), tmp_path / "d.parquet")
    assert read_corpus(tmp_path / "d.parquet") == documents
    pq.write_table(pa.table({"body": documents}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        read_corpus(tmp_path / "bad.parquet")


def write_saved_hf_dataset(folder, shards: list[list[str]]) -> None:
    """The `datasets.Dataset.save_to_disk` layout: IPC-stream .arrow shards + state.json + dataset_info.json."""
    folder.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        table = pa.table({"text": shard, "n": list(range(len(shard)))})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "x", "_split": "train"}
    (folder / "state.json").write_text(json.dumps(state))


def test_saved_hf_dataset_folder_reads_arrow_shards_in_state_order(tmp_path, documents):
    write_saved_hf_dataset(tmp_path / "ds", [documents[:3], documents[3:]])
    assert read_corpus(tmp_path / "ds") == documents


def test_saved_hf_dataset_dict_uses_train_split(tmp_path, documents):
    write_saved_hf_dataset(tmp_path / "dd" / "train", [documents])
    write_saved_hf_dataset(tmp_path / "dd" / "test", [["held out"]])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert read_corpus(tmp_path / "dd") == documents


def test_arrow_ipc_file_format(tmp_path, documents):
    table = pa.table({"text": documents})
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert read_corpus(tmp_path / "d.arrow") == documents


def test_folder_of_mixed_files_in_sorted_order_skipping_other_files(tmp_path, documents):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text(documents[0])
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": documents[1]}) + "\n")
    pq.write_table(pa.table({"text": documents[2:]}), tmp_path / "sub" / "c.parquet")
    (tmp_path / "README.md").write_text("not a document")
    assert read_corpus(tmp_path) == documents


def test_folder_suffixes_in_any_case_and_the_log_line_names_read_and_skipped_files(tmp_path, documents):
    (tmp_path / "A.TXT").write_text(documents[0])
    (tmp_path / "b.JSONL").write_text(json.dumps({"text": documents[1]}) + "\n")
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / ".cache").write_text("hidden files are no news")
    files = resolve_corpus_files("tinycorpus", str(tmp_path))
    assert [f.name for f in files] == ["A.TXT", "b.JSONL"]
    assert read_corpus(tmp_path) == documents[:2]
    line = describe_corpus(files, str(tmp_path))
    assert line.startswith("corpus: 2 files (A.TXT, b.JSONL); skipped 1 file of no corpus format")
    assert line.endswith(": notes.json")
    assert describe_corpus(files[:1], str(files[0])) == "corpus: 1 file (A.TXT)"


def test_a_corpus_file_that_links_to_nothing_is_an_error_not_skipped(tmp_path, documents):
    (tmp_path / "a.jsonl").symlink_to(tmp_path / "gone.jsonl")
    (tmp_path / "b.txt").write_text(documents[0])
    with pytest.raises(DatasetError, match=r"links to nothing: .*a\.jsonl; fix or remove them"):
        resolve_corpus_files("tinycorpus", str(tmp_path))


def test_empty_documents_are_skipped(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text('{"text": ""}\n{"text": "Emma"}\n')
    stream, num_documents = tokenize_corpus([tmp_path / "d.jsonl"], tokenizer)
    assert num_documents == 1 and stream.tolist() == tokenizer.encode("Emma", add_bos=True, add_eos=True)


# ---- validation split ----


def test_validation_holds_out_the_last_20th_of_each_shard_and_training_skips_it(tmp_path, tokenizer, make_job_config):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(45)))

    def tokens(indices) -> list[int]:
        return [t for i in indices for t in tokenizer.encode(f"document {i}", add_bos=True, add_eos=True)]

    job_config = make_job_config(path)
    assert stream_of(text_dataset(job_config, tokenizer, 0, 1)[0]) == tokens(range(45))
    job_config.validation.enable, job_config.validation.seq_len, job_config.validation.steps = True, 2, 1
    train, train_identity = text_dataset(job_config, tokenizer, 0, 1)
    held_out, identity = text_dataset(job_config, tokenizer, 0, 1, "validation")
    assert stream_of(held_out) == tokens([43, 44])  # 45 // 20 documents, the shard's last
    assert stream_of(train) == tokens(range(43))
    assert train_identity["data_sha256"] != identity["data_sha256"]
    assert (train.seq_len, train.local_batch_size) == (16, 2)
    assert (held_out.seq_len, held_out.local_batch_size) == (2, 2)  # its own seq_len, the training's batch size
    # a validation corpus of its own is read whole, and training reads every document again
    job_config.validation.dataset_path = str(path)
    assert stream_of(text_dataset(job_config, tokenizer, 0, 1, "validation")[0]) == tokens(range(45))
    assert stream_of(text_dataset(job_config, tokenizer, 0, 1)[0]) == tokens(range(45))


def test_more_validation_steps_than_the_set_holds_is_one_error(tmp_path, tokenizer, make_job_config):
    """Validation never repeats a batch within a pass: a set with fewer batches than validation.steps is an error."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(45)))
    job_config = make_job_config(path)
    job_config.validation.enable, job_config.validation.seq_len, job_config.validation.steps = True, 2, 1
    held = len(stream_of(text_dataset(job_config, tokenizer, 0, 1, "validation")[0])) // (3 * 2)
    job_config.validation.steps = held
    text_dataset(job_config, tokenizer, 0, 1, "validation")
    job_config.validation.steps = held + 1
    with pytest.raises(DatasetError, match=f"validation.steps={held + 1} needs .* more than its validation set holds"):
        text_dataset(job_config, tokenizer, 0, 1, "validation")


def test_a_corpus_too_small_to_hold_out_from_is_one_error(tokenizer, jsonl_corpus, make_job_config):
    job_config = make_job_config(jsonl_corpus)
    job_config.validation.enable = True
    with pytest.raises(
        DatasetError, match="4 documents, too few to hold the last 1/20 of each shard out .*--validation.dataset_path"
    ):
        text_dataset(job_config, tokenizer, 0, 1, "validation")


# ---- errors ----


def test_preflight_rejects_a_corpus_of_only_empty_documents(tmp_path):
    # the trainer skips empty documents, so the preflight must not count them as a corpus
    (tmp_path / "d.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    with pytest.raises(DatasetError, match="the corpus is empty"):
        check_corpus("tinycorpus", str(tmp_path / "d.jsonl"))


def test_a_corpus_of_only_whitespace_is_empty_to_preflight_and_trainer(tmp_path, tokenizer):
    (tmp_path / "w.txt").write_text("  \n\t\n")
    with pytest.raises(DatasetError, match="the corpus is empty"):
        check_corpus("tinycorpus", str(tmp_path / "w.txt"))
    with pytest.raises(DatasetError, match="the corpus is empty"):
        tokenize_corpus([tmp_path / "w.txt"], tokenizer)


def test_missing_dataset_path_names_the_config_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="--training.dataset_path"):
        resolve_corpus_files("tinycorpus", str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("name", ["data.csv", "empty_folder"])
def test_unsupported_dataset_path_names_the_config_key(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".csv"):
        path.write_text("text\nx\n")
    else:
        path.mkdir()
    with pytest.raises(ValueError, match="--training.dataset_path"):
        resolve_corpus_files("tinycorpus", str(path))


def test_a_dataset_path_that_is_neither_file_nor_folder_says_so():
    with pytest.raises(DatasetError, match="neither a file nor a folder"):
        resolve_corpus_files("tinycorpus", "/dev/null", "validation")


def test_unknown_dataset_name_without_path_is_an_error():
    with pytest.raises(ValueError, match="--training.dataset"):
        resolve_corpus_files("c4", None)


@pytest.mark.parametrize(
    "layout, message",
    [
        ({"state.json": "{bad"}, r"state.json: not valid JSON \(Expecting property name"),
        ({"dataset_dict.json": "{bad"}, r"dataset_dict.json: not valid JSON"),
        ({"a.parquet": "garbage"}, r"a.parquet: not a readable parquet file \(Parquet "),
        ({"b.arrow": "garbage"}, r"b.arrow: not a readable arrow file"),
        ({"state.json": '{"_data_files": [{}]}'}, r"state.json: '_data_files' is not a list of"),
        ({"state.json": "[]"}, r"state.json: expected a JSON object, found list"),
        ({"dataset_dict.json": "[1, 2]"}, r"dataset_dict.json: expected a JSON object, found list"),
        ({"state.json": b"\xe9t\xe9"}, r"state.json: not valid JSON \('utf-8' codec"),
    ],
    ids=["state-json", "dataset-dict-json", "parquet", "arrow", "entry-without-filename", "state-list",
         "dict-list", "not-utf8"],
)  # fmt: skip
def test_unreadable_dataset_files_are_one_error_naming_the_file(tmp_path, layout, message):
    for name, text in layout.items():
        (tmp_path / name).write_bytes(text) if isinstance(text, bytes) else (tmp_path / name).write_text(text)
    with pytest.raises(DatasetError, match=message):
        check_corpus("tinycorpus", str(tmp_path))


def _truncated_parquet(path) -> bytes:
    pq.write_table(pa.table({"text": ["a document"] * 10}), path)
    return path.read_bytes()[:-20]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("z.jsonl", b"garbage\n", r"z.jsonl:1: not a JSON object"),
        ("z.txt", b"\xff\xfe binary", r"z.txt: not UTF-8 text"),
        ("z.txt.gz", b"not gzip at all", r"z.txt.gz: cannot be read \(Not a gzipped file"),
        ("z.parquet", "truncated", r"z.parquet: not a readable parquet file"),
        ("z.arrow", b"garbage", r"z.arrow: not a readable arrow file"),
    ],
)
def test_preflight_checks_every_file_of_a_folder_not_only_until_a_good_document(tmp_path, name, content, message):
    # it stopped at the first good document, so a garbage file later in the folder was found only by the trainer
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "a good document first"}) + "\n")
    path = tmp_path / name
    path.write_bytes(_truncated_parquet(path) if content == "truncated" else content)
    with pytest.raises(DatasetError, match=message):
        check_corpus("tinycorpus", str(tmp_path))


def test_preflight_reads_only_the_start_of_each_file(tmp_path):
    (tmp_path / "big.txt").write_text("x" * (3 << 16) + "\udcff", errors="surrogateescape")  # bad byte past the start
    (document,) = read_documents(tmp_path / "big.txt", limit=100)
    assert len(document) == 1 << 16
    check_corpus("tinycorpus", str(tmp_path / "big.txt"))  # the trainer, which reads it all, names the byte
    with pytest.raises(DatasetError, match="not UTF-8 text"):
        read_documents(tmp_path / "big.txt")

    table = pa.table({"text": [f"document {i}" for i in range(1000)]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=100)
    stream, file = tmp_path / "stream.arrow", tmp_path / "file.arrow"
    with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=100)
    with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=100)
    for path in (tmp_path / "d.parquet", stream, file):
        assert read_documents(path, limit=5) == [f"document {i}" for i in range(5)], path
        assert len(read_documents(path)) == 1000, path


def test_a_cache_that_cannot_be_written_costs_only_this_runs_tokenizing(
    tokenizer, jsonl_corpus, monkeypatch, tmp_path, caplog
):
    (tmp_path / "not_a_folder").write_text("a file where the cache folder would go")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "not_a_folder" / "cache"))
    with caplog.at_level("WARNING"):
        stream, num_documents = tokenize_corpus([jsonl_corpus], tokenizer)
    assert "cannot cache the tokenized corpus" in caplog.text and num_documents == 4
    assert stream.tolist()[:1] == [tokenizer.bos_id]
