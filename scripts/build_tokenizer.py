"""Train the shipped byte-level BPE tokenizer (vocab 2048) on the shipped corpus.

    python scripts/build_tokenizer.py   # -> torchtitan/assets/tokenizer/tokenizer.json

Deterministic: the corpus is read in file order and the BPE trainer breaks ties by pair order, so the same
corpus and `tokenizers` version give a byte-identical tokenizer.json (checked with two runs on tokenizers 0.23).
The two special tokens take ids 0 and 1; the 256 byte tokens follow, then the merges.
"""

import argparse
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS = REPO_ROOT / "torchtitan/assets/tinycorpus/austen_chapters.jsonl.gz"
OUTPUT = REPO_ROOT / "torchtitan/assets/tokenizer/tokenizer.json"
VOCAB_SIZE = 2048
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="JSONL(.gz) file with a `text` field")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(read_texts(args.corpus), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    print(f"wrote {args.output} (vocab {tokenizer.get_vocab_size()})")


def read_texts(path: Path) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


if __name__ == "__main__":
    main()
