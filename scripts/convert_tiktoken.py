"""Write the `tokenizer.json` this trainer reads from a tiktoken-style tokenizer (Kimi K2's, Moonlight's).

    python scripts/convert_tiktoken.py /data/Kimi-K2-Instruct      # writes /data/Kimi-K2-Instruct/tokenizer.json

Kimi K2 and Moonlight ship `tiktoken.model` (base64 token bytes and their ranks) with the pre-tokenizer regex in
their Python tokenizer class, not a `tokenizers` file. This writes the same tokenizer as a byte-level BPE: every rank
a token id, every split of a token into two tokens a merge at that token's rank, and `ignore_merges` (a piece that is
a token is taken whole), which is tiktoken's algorithm; the special tokens of `tokenizer_config.json`'s
`added_tokens_decoder` at their ids (gaps filled with `<|reserved_token_N|>`, as Kimi's tokenizer class does). The
result is checked before it is written: every special token at its id, and every vocabulary entry and a sample text
encoded alike by tiktoken and the new file (pip install tiktoken).
"""

import argparse
import base64
import json
import sys
from pathlib import Path

KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
"""The pre-tokenizer regex of Kimi K2's and Moonlight's `tokenization_kimi.py`."""

SAMPLE = "Kimi K2 says: 12345 tokens, 中文字符 and ひらがな, don't STOP\n\n  indented\tline 🙂"


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model: one `base64(token bytes) rank` per line."""
    ranks = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"{path}:{number} is not `base64-token rank`: not a tiktoken.model file") from None
    return ranks


def special_tokens(config_path: Path, first_id: int) -> dict[str, int]:
    """The added tokens of tokenizer_config.json at their ids, from `first_id` up, gaps as Kimi's reserved names."""
    added = json.loads(config_path.read_text()).get("added_tokens_decoder", {}) if config_path.is_file() else {}
    named = {int(token_id): entry["content"] for token_id, entry in added.items()}
    if below := sorted(token_id for token_id in named if token_id < first_id):
        raise ValueError(
            f"{config_path}: added token id {below[0]} falls inside the {first_id} ranks of tiktoken.model"
        )
    last = max(named, default=first_id - 1)
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(first_id, last + 1)}


def convert(ranks: dict[bytes, int], pattern: str, specials: dict[str, int]) -> str:
    """The tokenizer.json text of tiktoken's BPE over `ranks`, split by `pattern`, with `specials`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    to_char = _char_of_byte()

    def text(token: bytes) -> str:
        return "".join(to_char[byte] for byte in token)

    merges = sorted(
        (rank, ranks[token[:cut]], ranks[token[cut:]], text(token[:cut]), text(token[cut:]))
        for token, rank in ranks.items()
        for cut in range(1, len(token))
        if token[:cut] in ranks and token[cut:] in ranks
    )
    vocab = {text(token): rank for token, rank in ranks.items()}
    tokenizer = Tokenizer(BPE(vocab, [(left, right) for *_, left, right in merges], ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    ordered = sorted(specials.items(), key=lambda item: item[1])
    tokenizer.add_special_tokens([AddedToken(content, normalized=False, special=True) for content, _ in ordered])
    for content, token_id in ordered:
        if tokenizer.token_to_id(content) != token_id:
            raise ValueError(f"special token {content!r} landed at id {tokenizer.token_to_id(content)}, not {token_id}")
    return tokenizer.to_str()


def check(tokenizer_json: str, ranks: dict[bytes, int], pattern: str, specials: dict[str, int]) -> None:
    """tiktoken and the converted file encode every decodable vocabulary entry and SAMPLE alike."""
    import tiktoken
    from tokenizers import Tokenizer

    encoding = tiktoken.Encoding("converted", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    converted = Tokenizer.from_str(tokenizer_json)
    texts = [SAMPLE, *(token.decode("utf-8") for token in ranks if _is_utf8(token))]
    theirs = encoding.encode_batch(texts, num_threads=1, allowed_special="all")
    ours = [e.ids for e in converted.encode_batch_fast(texts, add_special_tokens=False)]
    if different := [text for text, a, b in zip(texts, theirs, ours, strict=True) if a != b]:
        raise ValueError(f"the converted tokenizer encodes {different[0]!r} differently from tiktoken")


def _char_of_byte() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character a byte-level vocabulary writes each byte as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(len(others))]
    return {byte: chr(char) for byte, char in zip(printable + others, chars, strict=True)}


def _is_utf8(token: bytes) -> bool:
    try:
        token.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the release's folder: tiktoken.model and tokenizer_config.json")
    parser.add_argument("--pattern", default=KIMI_PATTERN, help="the pre-tokenizer regex (default: Kimi's)")
    parser.add_argument("--out", type=Path, help="where to write tokenizer.json (default: in the folder)")
    args = parser.parse_args(argv)
    model_file = args.folder / "tiktoken.model"
    out = args.out or args.folder / "tokenizer.json"
    try:
        if not model_file.is_file():
            raise ValueError(f"{model_file} does not exist: give the folder holding the release's tiktoken.model")
        ranks = read_ranks(model_file)
        specials = special_tokens(args.folder / "tokenizer_config.json", len(ranks))
        tokenizer_json = convert(ranks, args.pattern, specials)
        check(tokenizer_json, ranks, args.pattern, specials)
    except (ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out.write_text(tokenizer_json)
    print(f"wrote {out}: {len(ranks)} tokens and {len(specials)} special tokens, encoding checked against tiktoken")
    return 0


if __name__ == "__main__":
    sys.exit(main())
