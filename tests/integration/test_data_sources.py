"""The trainer on data a user brings: files written by Megatron-LM's own builder, blended with the shipped corpus,
trained by two data-parallel ranks with block-causal attention (documents from the Megatron index, which has no BOS),
and resumed at one rank from their checkpoint with the same losses as a straight run."""

import json
import shutil

import numpy as np
import pytest

from tests.integration.conftest import FAST_ARGS, read_losses, run_trainer


@pytest.fixture(scope="module")
def megatron_prefix(tmp_path_factory):
    """Megatron-core's IndexedDatasetBuilder, as tools/preprocess_data.py uses it: documents of ids below the debug
    model's vocabulary, without BOS / EOS, uint16 (its dtype for vocabularies under 65,500). In this process:
    `importorskip` has imported megatron-core already."""
    pytest.importorskip("megatron.core", reason="megatron-core is a dev dependency (pip install -e '.[dev]')")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path_factory.mktemp("megatron") / "code_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(200):
        document = rng.integers(3, 2048, size=rng.integers(5, 60))
        builder.add_document(document, [document.size])
    builder.finalize(f"{prefix}.idx")
    return prefix


def test_a_blend_with_megatron_files_trains_and_resumes_at_another_dp_degree(tmp_path, megatron_prefix):
    blend = f"0.6:{megatron_prefix},0.4:torchtitan/assets/tinycorpus/austen_chapters.jsonl.gz"
    args = [
        *FAST_ARGS,
        "--training.dataset_blend", blend,
        "--model.attn_mask_type", "block_causal",
        "--training.global_batch_size", "8",
        "--training.steps", "6",
    ]  # fmt: skip
    straight = tmp_path / "straight"
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "3"]
    run_trainer(straight, [*args, *checkpoint, "--training.local_batch_size", "4"], nproc=2)
    resumed_folder = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoint" / "step-3", resumed_folder / "checkpoint" / "step-3")
    run_trainer(resumed_folder, [*args, *checkpoint, "--training.local_batch_size", "8"], nproc=1)

    losses = read_losses(straight)
    assert sorted(losses) == list(range(1, 7)) and all(loss == loss for loss in losses.values())
    resumed = read_losses(resumed_folder)
    assert sorted(resumed) == [4, 5, 6]
    for step in range(4, 7):  # one rank of batch 8 reads the samples two ranks of batch 4 would
        assert resumed[step] == pytest.approx(losses[step], rel=1e-5), step
    last = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()][-1]
    tokens = {key: value for key, value in last.items() if key.startswith("data_tokens/")}
    assert set(tokens) == {"data_tokens/code_text_document", "data_tokens/austen_chapters.jsonl.gz"}
    assert sum(tokens.values()) == 6 * 8 * 32  # steps x sequences x tokens
    assert tokens["data_tokens/code_text_document"] == pytest.approx(0.6 * 6 * 8 * 32, abs=32)
