"""Tokenize a corpus once into token shards the trainer memory-maps (`--training.dataset_path OUT`).

    python scripts/tokenize_corpus.py /data/fineweb/ --out /data/fineweb_shards \
        --tokenizer torchtitan/assets/tokenizer/tokenizer.json --workers 16

SRC: any corpus the trainer reads (jsonl[.gz], txt[.gz], parquet, arrow, saved HF datasets, folders of them); several
are read in the order given. Large files are cut into parts of about --part-mib of text (byte ranges of a .jsonl, row
groups of a Parquet file), each tokenized by one of --workers processes into one shard (Megatron-LM's .bin/.idx
layout), with memory per worker bounded whatever the file sizes. The same command resumes after a kill: finished
shards are checked and kept, a partial one is redone.

On a cluster, run N independent parts and one final join (a Slurm array, or any scheduler):

    python scripts/tokenize_corpus.py SRC --out OUT --tokenizer T --part $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT
    python scripts/tokenize_corpus.py SRC --out OUT --tokenizer T --join    # after every part finished

`--verify OUT` reads every byte of a shard folder against its manifest's checksums. Prints one JSON line of what it
did (parts, MB/s of text per worker, peak memory per worker).
"""

import argparse
import json
import sys
from pathlib import Path

from torchtitan.datasets.corpus import DatasetError, resolve_corpus_files
from torchtitan.datasets.shards import MANIFEST, read_manifest
from torchtitan.datasets.tokenize_shards import join, plan_parts, shard_problems, tokenize_parts
from torchtitan.datasets.tokenizer import resolve_tokenizer_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="*", metavar="SRC", help="corpus files or folders, read in this order")
    parser.add_argument("--out", type=Path, help="the shard folder to write (created; resumed if it exists)")
    parser.add_argument("--tokenizer", default="torchtitan/assets/tokenizer/tokenizer.json", help="tokenizer.json")
    parser.add_argument("--workers", type=int, default=1, help="processes tokenizing parts in parallel")
    parser.add_argument("--part-mib", type=float, default=256, help="text per part (one shard) of a large file")
    parser.add_argument("--part", help="I/N: only parts i with i %% N == I (one task of a job array); no manifest")
    parser.add_argument("--join", action="store_true", help="only write the manifest of finished parts")
    parser.add_argument("--verify", type=Path, metavar="DIR", help="check every shard of DIR against its manifest")
    args = parser.parse_args(argv)
    try:
        if args.verify is not None:
            return verify(args.verify)
        if not args.sources or args.out is None:
            parser.error("give SRC... and --out (or --verify DIR)")
        if args.workers < 1 or args.part_mib <= 0:
            parser.error("--workers must be >= 1 and --part-mib > 0")
        tokenizer = resolve_tokenizer_path(args.tokenizer)
        files = [f for source in args.sources for f in resolve_corpus_files("", source, "tokenize")]
        parts = plan_parts(files, int(args.part_mib * 2**20))
        if args.join:
            manifest = join(args.out, parts, tokenizer)
            print(json.dumps({"joined": len(parts), "tokens": manifest["num_tokens"], "out": str(args.out)}))
            return 0
        only = _parse_part(args.part) if args.part else None
        done = tokenize_parts(parts, args.out, tokenizer, args.workers, only)
        busy_workers = max(1, min(args.workers, done["parts"]))
        report = {
            "parts": len(parts),
            "tokenized_now": done["parts"],
            "text_mb": round(done["text_bytes"] / 1e6, 1),
            "seconds": round(done["seconds"], 1),
            "mb_per_s_per_worker": round(done["text_bytes"] / 1e6 / max(done["seconds"], 1e-9) / busy_workers, 2),
            "peak_rss_mib_per_worker": round(done["peak_rss_mib"]),
            "parts_by_encoder": done["parts_by_encoder"],
            "documents_checked_against_tokenizers": done["checked_documents"],
        }
        if only is None:
            report["tokens"] = join(args.out, parts, tokenizer)["num_tokens"]
        print(json.dumps(report))
        return 0
    except (DatasetError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def verify(folder: Path) -> int:
    manifest = read_manifest(folder)
    problems = [problem for entry in manifest["shards"] for problem in shard_problems(folder, entry)]
    for problem in problems:
        print(f"error: {problem}; tokenize the corpus again into {folder} (shards that still match are kept)")
    if not problems:
        print(json.dumps({"verified": len(manifest["shards"]), "tokens": manifest["num_tokens"], "manifest": MANIFEST}))
    return 1 if problems else 0


def _parse_part(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise DatasetError(f"--part {text!r} is not I/N with 0 <= I < N, e.g. --part 3/16")
    return int(index), int(count)


if __name__ == "__main__":
    sys.exit(main())
