"""A chat dataset from the shipped corpus: fine-tuning jobs and benchmarks run without downloads.

    python scripts/chat_corpus.py OUT_DIR [--turns 2]

Writes OUT_DIR/chats.jsonl (`messages` records: each user turn gives a paragraph of the shipped Austen chapters and
asks for the next; the assistant's reply is that next paragraph) and OUT_DIR/tokenizer/ (the shipped tokenizer.json
beside a tokenizer_config.json carrying DeepSeek-V3-0324's chat template, tests/unit/datasets/chat_templates/). Pass
them as --training.dataset_path OUT_DIR/chats.jsonl --model.tokenizer_path OUT_DIR/tokenizer/tokenizer.json with
--training.dataset_format chat. The replies are real text, so the loss falls as it would on a real SFT set.
"""

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS = REPO_ROOT / "torchtitan/assets/tinycorpus/austen_chapters.jsonl.gz"
TOKENIZER = REPO_ROOT / "torchtitan/assets/tokenizer/tokenizer.json"
TEMPLATE = REPO_ROOT / "tests/unit/datasets/chat_templates/deepseek_v3_0324.jinja"


def conversations(turns: int) -> list[dict]:
    """One conversation per `turns` + 1 consecutive paragraphs of each chapter."""
    records = []
    with gzip.open(CORPUS, "rt") as f:
        for line in f:
            paragraphs = [p.strip() for p in json.loads(line)["text"].split("\n\n") if p.strip()]
            for start in range(0, len(paragraphs) - turns, turns + 1):
                messages = []
                for i in range(start, start + turns):
                    messages.append({"role": "user", "content": f"Continue the story:\n{paragraphs[i]}"})
                    messages.append({"role": "assistant", "content": paragraphs[i + 1]})
                records.append({"messages": messages})
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--turns", type=int, default=2, help="user/assistant exchanges per conversation")
    opts = parser.parse_args(argv)
    if opts.turns < 1:
        parser.error("--turns must be >= 1")
    tokenizer = opts.out / "tokenizer"
    tokenizer.mkdir(parents=True, exist_ok=True)
    shutil.copy(TOKENIZER, tokenizer / "tokenizer.json")
    config = {"chat_template": TEMPLATE.read_text(), "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    records = conversations(opts.turns)
    with open(opts.out / "chats.jsonl", "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    print(f"{len(records)} conversations in {opts.out / 'chats.jsonl'}; tokenizer in {tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
