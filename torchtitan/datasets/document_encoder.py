"""`DocumentEncoder`: the tokenize step's encoder, tiktoken's BPE where it gives `tokenizers`' ids, checked as it runs.

Why: the tokenize step runs at its encoder's rate, and on one thread tiktoken encodes a byte-level BPE about four times
faster than `tokenizers` (benchmarks/results/data_loader_*.json). The two merge differently in principle: `tokenizers`
applies the merges list in order, tiktoken merges the adjacent pair whose bytes form the lowest-ranked token. With
ranks = token ids and ids in merge order (what BPE training writes; scripts/convert_tiktoken.py writes every
split of a token as a merge at its id) they agree on every text standard training can
produce, but a hand-edited merges list can make them differ. So tiktoken is used only when the file's shape is one it
reads exactly (`tiktoken_encoding` says why not otherwise), every vocabulary entry encodes alike, and every
`CHECK_EVERY`-th document of each batch is encoded by both: one difference raises `EncoderMismatch`, and the caller
encodes that part again with `tokenizers` alone. A part's ids are therefore `tokenizers`' or checked against them.
"""

import json

import numpy as np

from torchtitan.datasets.tokenizer import Tokenizer

CHECK_EVERY = 16
"""One document in this many (the first of each run) is also encoded by `tokenizers` and compared."""

# The pre-tokenizer regex of `tokenizers`' ByteLevel(use_regex=True): GPT-2's.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class EncoderMismatch(RuntimeError):
    """tiktoken and `tokenizers` gave different ids for a document: encode the part with `tokenizers` alone."""


class DocumentEncoder:
    """Documents -> BOS + ids + EOS, with tiktoken when `tiktoken_encoding` allows it (and `fast`), else
    `tokenizers`. `backend` names which; `why_not_tiktoken` says why it is not tiktoken."""

    def __init__(self, tokenizer: Tokenizer, fast: bool = True):
        self.tokenizer = tokenizer
        self._tiktoken, self.why_not_tiktoken = tiktoken_encoding(tokenizer) if fast else (None, "not asked")
        self.backend = "tiktoken" if self._tiktoken is not None else "tokenizers"
        self.checked_documents = 0

    def encode_batch(self, documents: list[str]) -> list[np.ndarray]:
        """Each document as BOS + ids + EOS."""
        if self._tiktoken is None:
            encoded = self.tokenizer.encode_batch(documents, add_bos=True, add_eos=True)
            return [np.asarray(ids, dtype=np.int64) for ids in encoded]
        ids = [self._tiktoken.encode_to_numpy(document, allowed_special="all") for document in documents]
        checked = documents[::CHECK_EVERY]
        if self.tokenizer.encode_batch(checked) != [document_ids.tolist() for document_ids in ids[::CHECK_EVERY]]:
            raise EncoderMismatch(f"tiktoken and tokenizers differ on a document of {self.tokenizer.path}")
        self.checked_documents += len(checked)
        bos, eos = np.array([self.tokenizer.bos_id], np.uint32), np.array([self.tokenizer.eos_id], np.uint32)
        return [np.concatenate((bos, document_ids, eos)) for document_ids in ids]

    def encode(self, text: str) -> np.ndarray:
        """One piece of a longer document (no BOS / EOS), checked like a batch's first document."""
        return self.encode_batch([text])[0][1:-1]


def tiktoken_encoding(tokenizer: Tokenizer) -> tuple[object | None, str]:
    """(a `tiktoken.Encoding` giving this tokenizer's ids, "") or (None, why not): tiktoken missing, a shape it does
    not read exactly (not byte-level BPE, a normalizer, several split regexes, merges out of id order, ...), or a
    vocabulary entry it encodes differently."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed (pip install tiktoken: about 4x faster)"
    spec = json.loads(tokenizer.to_json())
    pattern, why_not = _split_pattern(spec)
    if pattern is None:
        return None, why_not
    model = spec["model"]
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
        return None, "the model is not a plain BPE (dropout or byte fallback)"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "the BPE has a subword prefix or suffix"
    special = {}
    for added in spec.get("added_tokens", []):
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            return None, f"added token {added['content']!r} strips or matches words"
        special[added["content"]] = added["id"]
    to_byte = _byte_of_char()
    ranks = {}
    for token, token_id in model["vocab"].items():
        if token in special:
            continue
        if any(char not in to_byte for char in token):
            return None, f"vocabulary entry {token!r} is not byte-level"
        ranks[bytes(to_byte[char] for char in token)] = token_id
    if len([token for token in ranks if len(token) == 1]) != 256:
        return None, "the vocabulary lacks some of the 256 bytes"
    merged_ids = [model["vocab"].get("".join(_merge_pair(merge))) for merge in model["merges"]]
    if None in merged_ids or any(a > b for a, b in zip(merged_ids[:-1], merged_ids[1:], strict=True)):
        return None, "the merges are not in token-id order"
    encoding = tiktoken.Encoding(
        name=f"torchtitan:{tokenizer.fingerprint}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special
    )
    texts = [token.decode("utf-8") for token in ranks if _is_utf8(token)]
    if encoding.encode_batch(texts, num_threads=1, allowed_special="all") != tokenizer.encode_batch(texts):
        return None, "tiktoken encodes some vocabulary entry differently"
    return encoding, ""


def _split_pattern(spec: dict) -> tuple[str | None, str]:
    """The one regex `tokenizers` splits text with before byte-level BPE, or (None, why not)."""
    if spec.get("normalizer"):
        return None, "the tokenizer has a normalizer"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return GPT2_PATTERN, ""
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) == 2:
        split, byte_level = steps
        if (
            split.get("type") == "Split"
            and "Regex" in split.get("pattern", {})
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and byte_level.get("type") == "ByteLevel"
            and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space")
        ):
            return split["pattern"]["Regex"], ""
    return None, "the pre-tokenizer is not one split regex and byte-level (e.g. a sequence of several splits)"


def _merge_pair(merge: str | list[str]) -> list[str]:
    return merge.split(" ") if isinstance(merge, str) else merge


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(len(others))]
    return {chr(char): byte for char, byte in zip(chars, printable + others, strict=True)}


def _is_utf8(token: bytes) -> bool:
    try:
        token.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
