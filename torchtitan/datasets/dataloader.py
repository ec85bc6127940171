"""`build_dataloader`: a resumable StatefulDataLoader over this rank's share of the packed sample stream."""

import pickle
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.text_datasets import PackedTextDataset, build_text_dataset
from torchtitan.datasets.tokenizer import Tokenizer

# Identity entries recorded in the state but not compared on load: the corpus may move to another folder.
INFORMATIONAL_IDENTITY_KEYS = ("dataset",)


class ParallelAwareDataloader(StatefulDataLoader):
    """StatefulDataLoader whose state is keyed by dp rank and stamped with the data's identity.

    `state_dict()` is `{"dp_world_size": W, "dp_rank_<r>": pickled {"identity", "loader"}}`: the per-rank key
    keeps ranks' states apart when a distributed checkpoint merges them (DCP deduplicates equal keys), and
    the identity (hash of the token stream, tokenizer fingerprint, seq_len, local batch size, dp world size) makes
    a resume with different data or layout fail loudly instead of silently training on other samples.
    """

    def __init__(
        self,
        dataset: PackedTextDataset,
        identity: dict[str, Any],
        dp_rank: int,
        dp_world_size: int,
        batch_size: int,
        num_workers: int = 0,
    ):
        super().__init__(dataset, batch_size=batch_size, num_workers=num_workers)
        self.identity = identity
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._rank_key = f"dp_rank_{dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        rank_state = {"identity": self.identity, "loader": super().state_dict()}
        return {"dp_world_size": self.dp_world_size, self._rank_key: pickle.dumps(rank_state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_world_size = state_dict.get("dp_world_size")
        if saved_world_size != self.dp_world_size:
            raise ValueError(
                f"dataloader state was saved with dp_world_size={saved_world_size}, this run has "
                f"{self.dp_world_size}; resume with the same data-parallel degree"
            )
        if self._rank_key not in state_dict:
            raise ValueError(f"dataloader state has no entry for {self._rank_key} (keys: {sorted(state_dict)})")
        rank_state = pickle.loads(state_dict[self._rank_key])
        saved_identity = rank_state["identity"]
        mismatched = {
            name: (saved_identity.get(name), value)
            for name, value in self.identity.items()
            if name not in INFORMATIONAL_IDENTITY_KEYS and saved_identity.get(name) != value
        }
        if mismatched:
            details = ", ".join(f"{name}: saved {saved!r}, now {now!r}" for name, (saved, now) in mismatched.items())
            raise ValueError(
                f"dataloader state does not match this run ({details}); resume with the same dataset, "
                "tokenizer, --training.seq_len, --training.local_batch_size and data-parallel degree"
            )
        super().load_state_dict(rank_state["loader"])


def build_dataloader(
    job_config: JobConfig,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int = 0,
) -> ParallelAwareDataloader:
    """Loader yielding `({"input": (L, seq_len) int64}, labels (L, seq_len) int64)` forever.

    L = `training.local_batch_size`. Every dp degree sees the same global batches (see text_datasets).
    """
    dataset, identity = build_text_dataset(job_config, tokenizer, dp_rank, dp_world_size)
    return ParallelAwareDataloader(
        dataset,
        identity,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=job_config.training.local_batch_size,
        num_workers=num_workers,
    )
