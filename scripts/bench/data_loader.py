"""What one rank's data loader costs at corpus sizes from 0.2 GB to 20 GB of tokens: memory, start-up, throughput.

    python scripts/bench/data_loader.py --corpus-dir /scratch/bench_corpora --gib 0.2 20 --tokenize-mib 200

For each size it writes (once) a synthetic shard folder of uint16 tokens outside the repository (random ids, document
lengths drawn around 1,000 tokens, a real manifest), then starts a fresh process per measurement, as a training rank
would start: rank 0 of `--dp` data-parallel ranks, `--batch` x `--seq-len` tokens a batch, the trainer's loader
(`build_dataloader`, no worker processes). Each process reports
- its resident memory after imports (its own baseline) and after `--batches` batches: the growth is what the data
  costs per rank;
- seconds from its start to the first batch, and from its loader's start (after the imports);
- tokens/s over the batches, with the shard pages in the page cache (warm) and evicted first (cold, posix_fadvise).
`--tokenize-mib` also tokenizes that much synthetic text with scripts/tokenize_corpus.py and reports MB/s of text per
worker and the peak memory per worker. One JSON in benchmarks/results/ (or $BENCH_OUT).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = REPO_ROOT / "torchtitan/assets/tokenizer/tokenizer.json"
SHARD_TOKENS = 1 << 29  # 1 GiB of uint16 tokens a shard, as the tokenizer's 256 MiB text parts give about


def make_corpus(folder: Path, gib: float) -> Path:
    """A shard folder of `gib` GiB of uint16 tokens (synthetic; reused when its manifest exists)."""
    from torchtitan.datasets.indexed import IndexedShardWriter
    from torchtitan.datasets.tokenize_shards import MANIFEST, write_manifest
    from torchtitan.datasets.tokenizer import Tokenizer

    out = folder / f"synthetic_{gib:g}gib"
    if (out / MANIFEST).is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(TOKENIZER)
    generator = np.random.default_rng(0)
    remaining, entries = int(gib * 2**30) // 2, []
    while remaining:
        shard_tokens = min(SHARD_TOKENS, remaining)
        writer = IndexedShardWriter(out / f"shard-{len(entries):06d}", np.uint16)
        written = 0
        while written < shard_tokens:
            lengths = np.minimum(generator.geometric(1 / 1000, size=4096) + 2, shard_tokens - written)
            lengths = lengths[: np.searchsorted(np.cumsum(lengths), shard_tokens - written, side="right") + 1]
            tokens = generator.integers(3, tokenizer.vocab_size, size=int(lengths.sum()), dtype=np.uint16)
            for document in np.split(tokens, np.cumsum(lengths)[:-1]):
                if document.size:
                    writer.append(document)
                    writer.end_document()
            written += int(lengths.sum())
        entries.append({"name": writer.prefix.name, "part": {}, "text_documents": 1, **writer.finish()})
        remaining -= shard_tokens
    write_manifest(out, entries, tokenizer)
    return out


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (clean pages: no privileges needed)."""
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def rank_process(args: argparse.Namespace) -> None:
    """One rank: imports, baseline memory, the loader, `--batches` batches; prints one JSON line."""
    started = time.perf_counter()
    import torch  # noqa: F401  (the trainer has it imported before its loader)

    from torchtitan.config.job_config import JobConfig
    from torchtitan.datasets.dataloader import build_dataloader
    from torchtitan.datasets.tokenizer import Tokenizer

    imported = time.perf_counter()
    baseline = rss_mib()
    job_config = JobConfig()
    job_config.training.dataset_path = str(args.rank_corpus)
    job_config.training.seq_len, job_config.training.local_batch_size = args.seq_len, args.batch
    loader = build_dataloader(job_config, Tokenizer(TOKENIZER), 2048, 0, args.dp)
    iterator = iter(loader)
    next(iterator)
    first_batch = time.perf_counter()
    tokens = 0
    for _ in range(args.batches):
        _, labels = next(iterator)
        tokens += labels.numel()
    seconds = time.perf_counter() - first_batch
    print(
        json.dumps(
            {
                "import_seconds": imported - started,
                "seconds_to_first_batch": first_batch - imported,
                "seconds_launch_to_first_batch": first_batch - started,
                "tokens_per_second": tokens / seconds,
                "baseline_rss_mib": baseline,
                "rss_growth_mib": rss_mib() - baseline,
            }
        )
    )


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(args: argparse.Namespace, corpus: Path, cold: bool) -> dict:
    if cold:
        evict(corpus)
    command = [sys.executable, __file__, "--rank-corpus", str(corpus), *_rank_flags(args)]
    run = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    return json.loads(run.stdout.strip().splitlines()[-1])


def tokenize_rate(folder: Path, mib: float, workers: int) -> dict:
    """Tokenize `mib` MiB of English-like text (the shipped corpus, repeated) with --workers processes."""
    from torchtitan.datasets.corpus import TINYCORPUS_PATH, read_documents

    source = folder / f"text_{mib:g}mib"
    if not source.is_dir():
        source.mkdir(parents=True)
        documents = read_documents(TINYCORPUS_PATH)
        with open(source / "text.jsonl", "w") as f:
            while f.tell() < mib * 2**20:
                f.writelines(json.dumps({"text": d}) + "\n" for d in documents)
    out = folder / f"tokenized_{mib:g}mib"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    part_mib = mib / (2 * workers)  # enough parts to keep every worker busy
    command = [sys.executable, "scripts/tokenize_corpus.py", str(source), "--out", str(out), "--tokenizer"]
    command += [str(TOKENIZER), "--workers", str(workers), "--part-mib", str(part_mib)]
    run = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    return json.loads(run.stdout.strip().splitlines()[-1])


def _rank_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--seq-len", args.seq_len, "--batch", args.batch, "--dp", args.dp, "--batches", args.batches]
    return [str(flag) for flag in flags]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-dir", type=Path, help="where the synthetic corpora go (outside the repository)")
    parser.add_argument("--gib", type=float, nargs="+", default=[0.2, 20.0], help="corpus sizes, GiB of tokens")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (the 16B job's local batch)")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel ranks of the job (this process is rank 0)")
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--tokenize-mib", type=float, default=0, help="also time the tokenizer on this much text")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="tokenizer worker processes, each timed")
    parser.add_argument("--rank-corpus", type=Path, help=argparse.SUPPRESS)  # internal: run as one rank
    args = parser.parse_args()
    if args.rank_corpus is not None:
        return rank_process(args)
    if args.corpus_dir is None or REPO_ROOT in args.corpus_dir.resolve().parents:
        parser.error("give --corpus-dir outside the repository (the corpora are GBs)")

    sys.path.insert(0, str(REPO_ROOT))
    from scripts.bench.common import git_commit, write_result

    sizes = []
    for gib in args.gib:
        corpus = make_corpus(args.corpus_dir, gib)
        measure(args, corpus, cold=False)  # warms the page cache
        warm, cold = measure(args, corpus, cold=False), measure(args, corpus, cold=True)
        sizes.append({"gib_of_tokens": gib, "tokens": json.loads((corpus / "manifest.json").read_text())["num_tokens"]})
        sizes[-1] |= {"warm": warm, "cold": cold}
        print(json.dumps(sizes[-1]))
    result = {
        "benchmark": "data_loader",
        "machine": f"{os.cpu_count()} CPU cores",
        "settings": {"seq_len": args.seq_len, "batch": args.batch, "dp": args.dp, "batches": args.batches},
        "sizes": sizes,
    }
    if len(sizes) > 1:
        small, large = sizes[0]["warm"], sizes[-1]["warm"]
        result["rss_growth_difference_mib"] = large["rss_growth_mib"] - small["rss_growth_mib"]
        result["launch_to_first_batch_ratio"] = (
            large["seconds_launch_to_first_batch"] / small["seconds_launch_to_first_batch"]
        )
        result["loader_to_first_batch_ratio"] = large["seconds_to_first_batch"] / small["seconds_to_first_batch"]
    if args.tokenize_mib:
        tokenized = [tokenize_rate(args.corpus_dir, args.tokenize_mib, workers) for workers in args.workers]
        result["tokenizer"] = [{"workers": workers, **t} for workers, t in zip(args.workers, tokenized, strict=True)]
    print(json.dumps({k: v for k, v in result.items() if k != "sizes"}))
    print(write_result(result, f"data_loader_{git_commit()[:7]}"))


if __name__ == "__main__":
    main()
