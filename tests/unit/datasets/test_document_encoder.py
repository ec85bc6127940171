"""The tokenize step's encoder: tiktoken only where it gives `tokenizers`' ids, and `tokenizers` when it would not."""

import json
import sys
from pathlib import Path

import pytest

from torchtitan.datasets.corpus import TINYCORPUS_PATH, read_documents
from torchtitan.datasets.document_encoder import DocumentEncoder, tiktoken_encoding
from torchtitan.datasets.indexed import IndexedShard
from torchtitan.datasets.tokenize_shards import plan_parts, tokenize_part
from torchtitan.datasets.tokenizer import Tokenizer

SHIPPED = Path(__file__).resolve().parents[3] / "torchtitan/assets/tokenizer/tokenizer.json"
EDGE_TEXTS = [
    "",
    "   leading and trailing   ",
    "I'll say it's 12345 or 3.14159, isn't it?\n\n\tTabs\r\nand CRLF",
    "Ünïcödé, 中文字符, emoji 🙂🚀 and combining é",
    "a literal <|end_of_text|> inside and <|begin_of_text|> too",
    "x" * 5000,
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(SHIPPED)


def test_the_shipped_tokenizer_encodes_with_tiktoken_to_the_same_ids(tokenizer):
    encoder = DocumentEncoder(tokenizer)
    assert encoder.backend == "tiktoken", encoder.why_not_tiktoken
    documents = read_documents(TINYCORPUS_PATH) + EDGE_TEXTS
    expected = tokenizer.encode_batch(documents, add_bos=True, add_eos=True)
    assert [ids.tolist() for ids in encoder.encode_batch(documents)] == expected
    assert encoder.checked_documents == len(documents[::16])
    assert [encoder.encode(text).tolist() for text in EDGE_TEXTS] == [tokenizer.encode(text) for text in EDGE_TEXTS]


def edited_tokenizer(tmp_path, edit) -> Tokenizer:
    spec = json.loads(SHIPPED.read_text())
    edit(spec)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return Tokenizer(path)


def test_merges_out_of_id_order_fall_back_to_tokenizers(tmp_path):
    def swap_two_merged_ids(spec):
        vocab = spec["model"]["vocab"]
        first, second = ("".join(merge) for merge in spec["model"]["merges"][:2])  # merges are [left, right]
        vocab[first], vocab[second] = vocab[second], vocab[first]

    encoder = DocumentEncoder(edited_tokenizer(tmp_path, swap_two_merged_ids))
    assert encoder.backend == "tokenizers"
    assert "not in token-id order" in encoder.why_not_tiktoken


def test_a_merge_tiktoken_would_take_differently_falls_back_to_tokenizers(tmp_path):
    """`bc` merged before `ab`, then `ab c` -> `abc`: `tokenizers` leaves "abc" as a + bc, tiktoken takes abc."""

    def add_a_merge_that_rank_order_takes_differently(spec):
        vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
        rank = {"".join(merge): i for i, merge in enumerate(merges)}
        pairs = [
            (ab, bc)
            for ab in rank
            for bc in rank
            if len(ab) == len(bc) == 2 and ab[1] == bc[0] and rank[bc] < rank[ab] and ab + bc[1] not in vocab
        ]
        ab, bc = pairs[0]
        vocab[ab + bc[1]] = max(vocab.values()) + 1
        merges.append([ab, bc[1]])

    encoder = DocumentEncoder(edited_tokenizer(tmp_path, add_a_merge_that_rank_order_takes_differently))
    assert encoder.backend == "tokenizers"
    assert encoder.why_not_tiktoken == "tiktoken encodes some vocabulary entry differently"


def test_other_shapes_and_a_missing_tiktoken_say_why(tmp_path, tokenizer, monkeypatch):
    def add_normalizer(spec):
        spec["normalizer"] = {"type": "NFC"}

    assert tiktoken_encoding(edited_tokenizer(tmp_path, add_normalizer)) == (None, "the tokenizer has a normalizer")
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    encoding, why_not = tiktoken_encoding(tokenizer)
    assert encoding is None and "pip install tiktoken" in why_not


def test_a_checked_document_that_differs_makes_the_part_encode_again_with_tokenizers(tmp_path, tokenizer):
    documents = [f"Document {i}: Emma was handsome, clever and rich." for i in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    [part] = plan_parts([tmp_path / "docs.jsonl"])
    encoder = DocumentEncoder(tokenizer)
    real = encoder._tiktoken

    class OffByOne:
        def encode_to_numpy(self, text, **kwargs):
            return real.encode_to_numpy(text, **kwargs) + 1

    encoder._tiktoken = OffByOne()
    done = tokenize_part(encoder, part, tmp_path, 0)
    assert done["encoder"] == "tokenizers"
    shard = IndexedShard(tmp_path / "shard-000000")
    expected = [t for ids in tokenizer.encode_batch(documents, add_bos=True, add_eos=True) for t in ids]
    assert shard.tokens(0, shard.num_tokens).tolist() == expected
    assert json.loads((tmp_path / "shard-000000.json").read_text())["shard"]["num_tokens"] == len(expected)
