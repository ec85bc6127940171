import itertools
import pickle

import pytest
import torch

from torchtitan.config.manager import ResumeMismatchError
from torchtitan.datasets.dataloader import build_dataloader


def take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x["input"], y) for x, y in itertools.islice(loader, n)]


def assert_same_batches(a, b) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_batches_have_the_documented_shapes(tokenizer, make_job_config):
    loader = build_dataloader(make_job_config(seq_len=32, local_batch_size=3), tokenizer, 2048, 0, 1)
    input_dict, labels = next(iter(loader))
    assert set(input_dict) == {"input", "document_ids"}
    assert input_dict["input"].shape == labels.shape == (3, 32)
    assert input_dict["input"].dtype == labels.dtype == torch.int64
    assert torch.equal(input_dict["input"][:, 1:], labels[:, :-1])
    # the window's documents, from the shards' index: a new one begins at every BOS of the shipped corpus
    window = torch.cat([input_dict["input"], labels[:, -1:]], dim=1)
    assert input_dict["document_ids"].shape == (3, 33) and input_dict["document_ids"].dtype == torch.int32
    begins = torch.diff(input_dict["document_ids"], dim=1) == 1
    assert (
        torch.equal(begins, window[:, 1:] == tokenizer.bos_id)
        and not (torch.diff(input_dict["document_ids"]) > 1).any()
    )


def test_one_rank_batch_8_equals_two_ranks_batch_4_every_step(tokenizer, make_job_config):
    steps = 5
    single = take(build_dataloader(make_job_config(local_batch_size=8), tokenizer, 2048, 0, 1), steps)
    rank0 = take(build_dataloader(make_job_config(local_batch_size=4), tokenizer, 2048, 0, 2), steps)
    rank1 = take(build_dataloader(make_job_config(local_batch_size=4), tokenizer, 2048, 1, 2), steps)
    for (x, y), (x0, y0), (x1, y1) in zip(single, rank0, rank1, strict=True):
        assert torch.equal(x, torch.cat([x0, x1])) and torch.equal(y, torch.cat([y0, y1]))
    assert not torch.equal(rank0[0][0], rank1[0][0])


def test_one_rank_batch_4_equals_four_ranks_batch_1(tokenizer, make_job_config):
    single = take(build_dataloader(make_job_config(local_batch_size=4), tokenizer, 2048, 0, 1), 3)
    ranks = [take(build_dataloader(make_job_config(local_batch_size=1), tokenizer, 2048, r, 4), 3) for r in range(4)]
    for step, (x, y) in enumerate(single):
        assert torch.equal(x, torch.cat([ranks[r][step][0] for r in range(4)]))
        assert torch.equal(y, torch.cat([ranks[r][step][1] for r in range(4)]))


def test_state_round_trip_continues_exactly(tokenizer, make_job_config):
    job_config = make_job_config(local_batch_size=4)
    loader = build_dataloader(job_config, tokenizer, 2048, 1, 2)
    iterator = iter(loader)
    take(iterator, 3)
    state = pickle.loads(pickle.dumps(loader.state_dict()))  # survives serialization, as in a checkpoint
    expected = take(iterator, 2)

    resumed = build_dataloader(job_config, tokenizer, 2048, 1, 2)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 2), expected)


def test_state_round_trip_with_worker_processes(tokenizer, make_job_config):
    job_config = make_job_config(local_batch_size=2)
    in_process = take(build_dataloader(job_config, tokenizer, 2048, 0, 2), 6)
    loader = build_dataloader(job_config, tokenizer, 2048, 0, 2, num_workers=2)
    iterator = iter(loader)
    assert_same_batches(take(iterator, 3), in_process[:3])
    state = loader.state_dict()
    del iterator

    resumed = build_dataloader(job_config, tokenizer, 2048, 0, 2, num_workers=2)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 3), in_process[3:])


def test_state_is_keyed_by_rank_and_stamped_with_identity(tokenizer, make_job_config):
    loader = build_dataloader(make_job_config(), tokenizer, 2048, 1, 2)
    state = loader.state_dict()
    assert set(state) == {"dp_world_size", "dp_rank_1"} and state["dp_world_size"] == 2
    identity = pickle.loads(state["dp_rank_1"])["identity"]
    assert identity["tokenizer"] == tokenizer.fingerprint and identity["dataset"] == ["tinycorpus"]
    assert identity["num_documents"] == 269 and identity["num_tokens"] > 1_000_000


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seq_len": 32}, "seq_len"),
        ({"local_batch_size": 3}, "local_batch_size"),
        ({"dp_world_size": 4}, "whole batches"),  # 1 step x 2 ranks x 8 samples do not split over 4 x 8
    ],
)
def test_loading_state_from_a_different_layout_is_an_error(tokenizer, make_job_config, change, message):
    saved = build_dataloader(make_job_config(), tokenizer, 2048, 0, 2)
    take(saved, 1)
    state = saved.state_dict()
    world_size = change.pop("dp_world_size", 2)
    loader = build_dataloader(make_job_config(**change), tokenizer, 2048, 0, world_size)
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)


def test_loading_state_from_a_different_dataset_is_an_error(tokenizer, make_job_config, jsonl_corpus):
    state = build_dataloader(make_job_config(), tokenizer, 2048, 0, 1).state_dict()
    loader = build_dataloader(make_job_config(jsonl_corpus), tokenizer, 2048, 0, 1)
    with pytest.raises(ValueError, match="dataset"):
        loader.load_state_dict(state)


def test_resuming_with_validation_held_out_names_the_setting_not_damage(tokenizer, make_job_config):
    """--validation.enable without a validation corpus holds documents out of training: the token stream changes."""
    state = build_dataloader(make_job_config(), tokenizer, 2048, 0, 1).state_dict()
    job_config = make_job_config()
    job_config.validation.enable = True
    loader = build_dataloader(job_config, tokenizer, 2048, 0, 1)
    with pytest.raises(ResumeMismatchError, match=r"data_sha256: saved .*--validation.enable without") as err:
        loader.load_state_dict(state)
    assert "\n" not in str(err.value) and "delete" not in str(err.value)


def test_state_loads_when_the_same_corpus_moved_folder(tokenizer, make_job_config, jsonl_corpus, tmp_path):
    saved = build_dataloader(make_job_config(jsonl_corpus), tokenizer, 2048, 0, 1)
    iterator = iter(saved)
    take(iterator, 2)
    state = saved.state_dict()
    moved = tmp_path / "moved" / "corpus.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(jsonl_corpus.read_bytes())
    resumed = build_dataloader(make_job_config(moved), tokenizer, 2048, 0, 1)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 2), take(iterator, 2))


@pytest.mark.parametrize("world_size, local_batch_size, rank", [(1, 4, 0), (4, 1, 2), (4, 1, 3)])
def test_state_reshards_to_another_data_parallel_degree(tokenizer, make_job_config, world_size, local_batch_size, rank):
    """Saved by rank 1 of 2 ranks x batch 2 after 3 steps (12 global samples); resumed by another layout with the
    same global batch, each rank continues exactly where a straight run of that layout would be."""
    saved = build_dataloader(make_job_config(local_batch_size=2), tokenizer, 2048, 1, 2)
    take(saved, 3)
    state = saved.state_dict()

    job_config = make_job_config(local_batch_size=local_batch_size)
    steps_done = 12 // (world_size * local_batch_size)
    straight = take(build_dataloader(job_config, tokenizer, 2048, rank, world_size), steps_done + 2)
    resumed = build_dataloader(job_config, tokenizer, 2048, rank, world_size)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 2), straight[-2:])


def test_resuming_with_a_larger_global_micro_batch_warns(tokenizer, make_job_config, caplog):
    saved = build_dataloader(make_job_config(local_batch_size=2), tokenizer, 2048, 0, 1)
    take(saved, 2)
    state = saved.state_dict()
    resumed = build_dataloader(make_job_config(local_batch_size=2), tokenizer, 2048, 0, 2)
    with caplog.at_level("WARNING"):
        resumed.load_state_dict(state)
    assert any("changes by 2x" in r.getMessage() for r in caplog.records)
