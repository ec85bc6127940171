"""`Tokenizer`: a thin wrapper over a `tokenizers` JSON file with explicit BOS/EOS handling."""

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from torchtitan.config.job_config import JobConfig

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"

# Relative tokenizer paths: from the working directory, then the repository root (so the default works anywhere).
_REPO_ROOT = Path(__file__).resolve().parents[2]


class Tokenizer:
    """A `tokenizers.Tokenizer` whose BOS/EOS are the special tokens `<|begin_of_text|>` / `<|end_of_text|>` (the
    shipped tokenizer's), or those a Hugging Face folder's `tokenizer_config.json` beside the file names
    (DeepSeek's `<｜begin▁of▁sentence｜>` / `<｜end▁of▁sentence｜>`); added only when `encode` is asked to. The
    literal EOS token in a text encodes to `eos_id`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._tokenizer = HFTokenizer.from_file(str(self.path))
        except Exception as err:  # tokenizers raises a bare Exception for unreadable JSON
            raise ValueError(
                f"tokenizer {self.path} is not a `tokenizers` tokenizer.json ({err}); rebuild it with "
                "scripts/build_tokenizer.py or pass another --model.tokenizer_path"
            ) from None
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        bos, eos = special_tokens(self.path)
        self.bos_id: int = self._special_token_id(*bos)
        self.eos_id: int = self._special_token_id(*eos)
        # Stored in the dataloader state: a resume with another vocabulary or merges fails instead of feeding other ids.
        self.fingerprint: str = hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()[:16]

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return self._wrap(self._tokenizer.encode(text, add_special_tokens=False).ids, add_bos, add_eos)

    def encode_batch(self, texts: list[str], add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        """`encode` for many texts at once (parallel inside `tokenizers`; ids only, no offsets)."""
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [self._wrap(e.ids, add_bos, add_eos) for e in encodings]

    def encode_batch_with_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """(ids, each token's [start, end) characters) of each text, nothing added: which characters a token covers
        (chat data trains the tokens of the assistant's characters)."""
        return [(e.ids, e.offsets) for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def to_json(self) -> str:
        """The tokenizer.json this tokenizer was read from, as `tokenizers` writes it."""
        return self._tokenizer.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def _special_token_id(self, token: str, named_by: str | None) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None and named_by is not None:
            raise ValueError(
                f"{named_by} names {token!r}, a token tokenizer {self.path} does not have; fix that key (or remove "
                "the file) or pass the tokenizer it belongs to as --model.tokenizer_path"
            )
        if token_id is None:
            raise ValueError(
                f"tokenizer {self.path} has no special token {token!r}; rebuild it with "
                "scripts/build_tokenizer.py or pass another --model.tokenizer_path"
            )
        return token_id


def special_tokens(path: Path) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
    """(BOS, EOS), each (token, what named it): as the `tokenizer_config.json` next to `path` names them (a Hugging
    Face model folder; "<file>'s bos_token"), else ours (None)."""
    config_path = path.with_name("tokenizer_config.json")
    if not config_path.is_file():
        return (BOS_TOKEN, None), (EOS_TOKEN, None)
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path} (beside the tokenizer) is not valid JSON ({err}); fix or remove it") from None
    if not isinstance(config, dict):
        held = json.dumps(config)
        held = held if len(held) <= 40 else held[:37] + "..."
        raise ValueError(
            f"{config_path} (beside the tokenizer) is JSON but not an object (it holds {held}); fix or remove it"
        )

    def named(key: str, default: str) -> tuple[str, str | None]:
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return (token, f"{config_path}'s {key}") if isinstance(token, str) and token else (default, None)

    return named("bos_token", BOS_TOKEN), named("eos_token", EOS_TOKEN)


def build_tokenizer(job_config: JobConfig) -> Tokenizer:
    return Tokenizer(resolve_tokenizer_path(job_config.model.tokenizer_path))


def resolve_tokenizer_path(tokenizer_path: str) -> Path:
    path = Path(tokenizer_path).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, _REPO_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
        if candidate.is_dir():
            raise FileNotFoundError(
                f"--model.tokenizer_path={tokenizer_path!r} is a folder ({candidate}); give the tokenizer.json in it"
            )
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"tokenizer file not found: --model.tokenizer_path={tokenizer_path!r} (looked at {tried}); "
        "point --model.tokenizer_path at a `tokenizers` tokenizer.json, e.g. the shipped "
        "torchtitan/assets/tokenizer/tokenizer.json"
    )
