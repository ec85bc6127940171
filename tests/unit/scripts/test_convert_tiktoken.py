"""scripts/convert_tiktoken.py: a tiktoken.model + tokenizer_config.json (Kimi K2's layout) becomes a
tokenizer.json that encodes as tiktoken does with Kimi's regex, special tokens at their ids, and that the tokenize
step encodes fast."""

import base64
import json
from pathlib import Path

import pytest

from scripts import convert_tiktoken
from torchtitan.datasets.corpus import TINYCORPUS_PATH, read_documents
from torchtitan.datasets.document_encoder import DocumentEncoder
from torchtitan.datasets.tokenizer import Tokenizer

tiktoken = pytest.importorskip("tiktoken")
SHIPPED = Path(__file__).resolve().parents[3] / "torchtitan/assets/tokenizer/tokenizer.json"
TEXTS = ["深度学习 and ひらがな カタカナ mixed with ASCII", "Don'T SHOUT, it's 2026-12-06 at 08:00.\r\n\r\n  x"]


def byte_level_ranks() -> dict[bytes, int]:
    """The shipped tokenizer's byte-level tokens as tiktoken ranks (its id order, renumbered from 0)."""
    vocab = json.loads(SHIPPED.read_text())["model"]["vocab"]
    to_byte = {char: byte for byte, char in convert_tiktoken._char_of_byte().items()}
    tokens = [token for token in sorted(vocab, key=vocab.get) if all(char in to_byte for char in token)]
    return {bytes(to_byte[char] for char in token): rank for rank, token in enumerate(tokens)}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A folder laid out as Kimi K2's: tiktoken.model and tokenizer_config.json naming [BOS], [EOS], <|im_end|>."""
    folder = tmp_path_factory.mktemp("kimi")
    ranks = byte_level_ranks()
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    added = {str(n): "[BOS]", str(n + 1): "[EOS]", str(n + 3): "<|im_end|>"}
    config = {
        "added_tokens_decoder": {i: {"content": content, "special": True} for i, content in added.items()},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert convert_tiktoken.main([str(folder)]) == 0
    return folder, ranks


def test_the_converted_tokenizer_encodes_as_tiktoken_with_kimis_regex(release):
    folder, ranks = release
    n = len(ranks)
    specials = {"[BOS]": n, "[EOS]": n + 1, f"<|reserved_token_{n + 2}|>": n + 2, "<|im_end|>": n + 3}
    reference = tiktoken.Encoding("ref", pat_str=convert_tiktoken.KIMI_PATTERN, mergeable_ranks=ranks,
                                  special_tokens=specials)  # fmt: skip
    tokenizer = Tokenizer(folder / "tokenizer.json")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (n, n + 1, n + 4)
    texts = read_documents(TINYCORPUS_PATH)[:40] + TEXTS + ["a turn<|im_end|>"]
    assert tokenizer.encode_batch(texts) == [reference.encode(text, allowed_special="all") for text in texts]
    assert tokenizer.encode("a turn<|im_end|>")[-1] == n + 3


def test_the_tokenize_step_encodes_the_converted_tokenizer_with_tiktoken(release):
    encoder = DocumentEncoder(Tokenizer(release[0] / "tokenizer.json"))
    assert encoder.backend == "tiktoken", encoder.why_not_tiktoken


def test_a_folder_without_a_tiktoken_model_or_with_a_broken_one_is_one_line(tmp_path, capsys):
    assert convert_tiktoken.main([str(tmp_path)]) == 2
    assert "tiktoken.model does not exist" in capsys.readouterr().err
    (tmp_path / "tiktoken.model").write_text("not base64 at all\n")
    assert convert_tiktoken.main([str(tmp_path)]) == 2
    assert "tiktoken.model:1 is not `base64-token rank`" in capsys.readouterr().err
    assert not (tmp_path / "tokenizer.json").exists()
