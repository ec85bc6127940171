import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timeouts import generous_timeout
from torchtitan.datasets.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer, build_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_shipped_tokenizer_has_vocab_2048_with_bos_and_eos_inside(tokenizer: Tokenizer):
    assert tokenizer.vocab_size == 2048
    assert {tokenizer.bos_id, tokenizer.eos_id} == {0, 1}
    assert tokenizer.decode([tokenizer.bos_id]) == BOS_TOKEN
    assert tokenizer.decode([tokenizer.eos_id]) == EOS_TOKEN


@pytest.mark.parametrize(
    "text",
    ["It is a truth universally acknowledged", "  leading spaces\n\nand\ttabs ", "café naïve — 😀 日本", ""],
)
def test_encode_decode_round_trips_any_text(tokenizer: Tokenizer, text: str):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_encode_adds_bos_and_eos_only_when_asked(tokenizer: Tokenizer):
    plain = tokenizer.encode("Persuasion")
    assert tokenizer.bos_id not in plain and tokenizer.eos_id not in plain
    wrapped = tokenizer.encode("Persuasion", add_bos=True, add_eos=True)
    assert wrapped == [tokenizer.bos_id, *plain, tokenizer.eos_id]
    assert tokenizer.decode(wrapped, skip_special_tokens=True) == "Persuasion"
    assert tokenizer.encode_batch(["Persuasion"], add_bos=True) == [[tokenizer.bos_id, *plain]]


def test_special_token_text_in_input_encodes_to_the_special_id(tokenizer: Tokenizer):
    # Documented behaviour of `tokenizers` added tokens: literal "<|end_of_text|>" in text becomes EOS.
    assert tokenizer.eos_id in tokenizer.encode("a <|end_of_text|> b")


def test_build_tokenizer_finds_default_path_from_any_working_directory(tmp_path, monkeypatch, make_job_config):
    monkeypatch.chdir(tmp_path)
    assert build_tokenizer(make_job_config()).vocab_size == 2048


def test_build_tokenizer_missing_file_names_the_config_key(tmp_path, make_job_config):
    job_config = make_job_config()
    job_config.model.tokenizer_path = str(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="--model.tokenizer_path"):
        build_tokenizer(job_config)


def test_build_script_reproduces_shipped_tokenizer(tmp_path, repo_root):
    output = tmp_path / "tokenizer.json"
    subprocess.run(
        [sys.executable, str(repo_root / "scripts/build_tokenizer.py"), "--output", str(output)],
        check=True,
        capture_output=True,
        timeout=generous_timeout(300),
    )
    rebuilt, shipped = (
        json.loads(output.read_text()),
        json.loads((repo_root / "torchtitan/assets/tokenizer/tokenizer.json").read_text()),
    )
    assert rebuilt["model"]["vocab"] == shipped["model"]["vocab"]
    assert rebuilt["model"]["merges"] == shipped["model"]["merges"]
    assert rebuilt["added_tokens"] == shipped["added_tokens"]


def test_a_tokenizer_path_that_is_a_folder_says_so(tmp_path):
    from torchtitan.datasets.tokenizer import resolve_tokenizer_path

    with pytest.raises(FileNotFoundError, match=r"tokenizer_path=.* is a folder \(.*\); give the tokenizer.json in it"):
        resolve_tokenizer_path(str(tmp_path))


def test_a_hugging_face_folders_tokenizer_config_names_bos_and_eos(tmp_path):
    """DeepSeek's releases name them <｜begin▁of▁sentence｜> / <｜end▁of▁sentence｜> in tokenizer_config.json; the
    tokenizer.json alone (here the shipped one renamed) does not say which tokens they are."""
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    shipped = (REPO_ROOT / "torchtitan/assets/tokenizer/tokenizer.json").read_text()
    folder = tmp_path / "release"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(shipped.replace(BOS_TOKEN, bos).replace(EOS_TOKEN, eos))
    with pytest.raises(ValueError, match="has no special token '<|begin_of_text|>'"):
        Tokenizer(folder / "tokenizer.json")
    config = {"bos_token": {"content": bos, "lstrip": False}, "eos_token": eos}  # both forms HF writes
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(folder / "tokenizer.json")
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    assert tokenizer.decode(tokenizer.encode("Emma", add_bos=True, add_eos=True)) == f"{bos}Emma{eos}"
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json \(beside the tokenizer\) is not valid JSON"):
        Tokenizer(folder / "tokenizer.json")


@pytest.mark.parametrize("key", ["bos_token", "eos_token"])
def test_a_tokenizer_config_naming_a_token_the_tokenizer_lacks_names_the_config_and_its_key(tmp_path, key):
    """The tokenizer is fine; the config beside it asked for a token it does not have: the error says which file and
    key asked, not only the tokenizer's path."""
    folder = tmp_path / "release"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((REPO_ROOT / "torchtitan/assets/tokenizer/tokenizer.json").read_text())
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({key: {"content": "<｜missing｜>"}}))
    with pytest.raises(ValueError) as info:
        Tokenizer(folder / "tokenizer.json")
    message = str(info.value)
    assert message.startswith(f"{config}'s {key} names '<｜missing｜>', a token tokenizer ")
    assert "fix that key" in message and "\n" not in message


@pytest.mark.parametrize("text, held", [("[1, 2]", "[1, 2]"), ('"<s>"', '"<s>"'), ("null", "null")])
def test_a_tokenizer_config_that_is_json_but_not_an_object_is_refused(tmp_path, text, held):
    folder = tmp_path / "release"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((REPO_ROOT / "torchtitan/assets/tokenizer/tokenizer.json").read_text())
    (folder / "tokenizer_config.json").write_text(text)
    with pytest.raises(ValueError) as info:
        Tokenizer(folder / "tokenizer.json")
    assert str(info.value) == (
        f"{folder / 'tokenizer_config.json'} (beside the tokenizer) is JSON but not an object (it holds {held}); fix "
        "or remove it"
    )
