"""`build_dataloader`: a resumable StatefulDataLoader over this rank's share of the packed sample stream."""

import logging
import pickle
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ResumeMismatchError
from torchtitan.datasets.chat import build_chat_dataset
from torchtitan.datasets.text_datasets import PackedTextDataset, SplitLayout, build_text_dataset
from torchtitan.datasets.tokenizer import Tokenizer

# Identity entries recorded in the state but not compared on load: the corpus may move to another folder.
INFORMATIONAL_IDENTITY_KEYS = ("dataset",)
# Entries that may change when a checkpoint is resumed with another data-parallel layout (see _reshard).
LAYOUT_IDENTITY_KEYS = ("dp_world_size", "local_batch_size")
# The settings that change each identity entry, named in the error of a resume that does not match.
_TOKENS = (
    "the training tokens (--validation.enable without --validation.dataset_path holds the last 1/20 of every shard's "
    "documents out of training; --training.dataset, --training.dataset_path, --training.dataset_blend; chat data: its "
    "template and --training.chat_truncate too)"
)
CHANGED_SETTING = {
    "data_sha256": _TOKENS,
    "num_documents": _TOKENS,
    "num_tokens": _TOKENS,
    "tokenizer": "the tokenizer (--model.tokenizer_path)",
    "seq_len": "--training.seq_len",
    "local_batch_size": "--training.local_batch_size",
    "dp_world_size": "the data-parallel degree",
}

logger = logging.getLogger(__name__)


class ParallelAwareDataloader(StatefulDataLoader):
    """StatefulDataLoader whose state is keyed by dp rank and stamped with the data's identity.

    `state_dict()` is `{"dp_world_size": W, "dp_rank_<r>": pickled {"identity", "loader"}}`: the per-rank key keeps
    ranks apart when DCP merges equal keys, and the identity (token stream hash, tokenizer, seq_len, batch size, dp
    world size) makes a resume with different data fail loudly. A state saved with another dp degree is resharded: the
    sample stream is global, so every layout has consumed the same samples after S steps.
    """

    def __init__(self, dataset: PackedTextDataset, identity: dict[str, Any], num_workers: int = 0):
        super().__init__(dataset, batch_size=dataset.local_batch_size, num_workers=num_workers)
        self.identity = identity
        self.dp_world_size = dataset.dp_world_size
        self._rank_key = f"dp_rank_{dataset.dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        rank_state = {"identity": self.identity, "loader": super().state_dict()}
        return {"dp_world_size": self.dp_world_size, self._rank_key: pickle.dumps(rank_state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        same_layout = state_dict.get("dp_world_size") == self.dp_world_size
        rank_keys = sorted(key for key in state_dict if key.startswith("dp_rank_"))
        if same_layout and self._rank_key not in state_dict:
            raise ValueError(f"dataloader state has no entry for {self._rank_key} (keys: {sorted(state_dict)})")
        if not rank_keys:
            raise ValueError(f"dataloader state holds no rank entry (keys: {sorted(state_dict)})")
        rank_state = pickle.loads(state_dict[self._rank_key if same_layout else rank_keys[0]])
        saved_identity = rank_state["identity"]
        ignored = INFORMATIONAL_IDENTITY_KEYS + (() if same_layout else LAYOUT_IDENTITY_KEYS)
        mismatched = {
            name: (saved_identity.get(name), value)
            for name, value in self.identity.items()
            if name not in ignored and saved_identity.get(name) != value
        }
        if mismatched:
            details = ", ".join(f"{name}: saved {saved!r}, now {now!r}" for name, (saved, now) in mismatched.items())
            changed = " or ".join(dict.fromkeys(CHANGED_SETTING.get(name, name) for name in mismatched))
            raise ResumeMismatchError(
                f"dataloader state does not match this run ({details}): {changed} changed since the checkpoint was "
                "saved; resume with the settings it was saved with, or start a new run in another --job.dump_folder"
            )
        loader_state = rank_state["loader"]
        if not same_layout:
            saved_per_step = saved_identity["dp_world_size"] * saved_identity["local_batch_size"]
            now_per_step = self.dp_world_size * self.batch_size
            if saved_per_step != now_per_step:
                logger.warning(
                    f"resuming with data-parallel degree {self.dp_world_size} x local batch {self.batch_size} (the "
                    f"checkpoint was saved with {saved_identity['dp_world_size']} x "
                    f"{saved_identity['local_batch_size']}): the data continues where it stopped, but each "
                    f"micro-batch step now reads {now_per_step} sequences instead of {saved_per_step}; unless "
                    "--training.global_batch_size fixes the global batch, it changes by "
                    f"{now_per_step / saved_per_step:g}x (and with it the effective learning rate)"
                )
            loader_state = self._reshard(loader_state, saved_identity)
        super().load_state_dict(loader_state)

    def _reshard(self, loader_state: dict[str, Any], saved_identity: dict[str, Any]) -> dict[str, Any]:
        """A loader state of another dp degree -> this rank's position over the same consumed global samples."""
        if "dataset_state" not in loader_state or self.num_workers != 0:
            raise ValueError(
                "resuming the dataloader with another data-parallel degree needs num_workers=0 in both runs"
            )
        consumed = loader_state["dataset_state"]["samples_yielded"] * saved_identity["dp_world_size"]
        per_micro_step = self.dp_world_size * self.batch_size
        if consumed % per_micro_step:
            raise ValueError(
                f"the checkpoint's {consumed} consumed samples do not split into whole batches of "
                f"{self.dp_world_size} ranks x {self.batch_size}; resume with the saved layout"
            )
        local = consumed // self.dp_world_size
        batches = local // self.batch_size
        return {
            **loader_state,
            "dataset_state": {**loader_state["dataset_state"], "samples_yielded": local},
            "_sampler_iter_state": {"samples_yielded": local},
            "_sampler_iter_yielded": batches,
            "_num_yielded": batches,
        }


def build_dataloader(
    job_config: JobConfig,
    tokenizer: Tokenizer,
    vocab_size: int,
    dp_rank: int,
    dp_world_size: int,
    split: str = "train",
    num_workers: int = 0,
) -> ParallelAwareDataloader:
    """Loader yielding `({"input": (L, seq_len) int64, "document_ids": (L, seq_len + 1) int32}, labels (L, seq_len)
    int64)` forever, with the training's or the validation split's L and seq_len. Every dp degree sees the same global
    batches (see text_datasets). vocab_size: the model's (no token id may reach it). training.dataset_format chat:
    packed conversations whose labels are IGNORE_INDEX but on the assistant's replies (chat.py)."""
    build = build_chat_dataset if job_config.training.dataset_format == "chat" else build_text_dataset
    layout = SplitLayout.of(job_config, dp_rank, dp_world_size, split)
    dataset, identity = build(job_config, tokenizer, vocab_size, layout)
    return ParallelAwareDataloader(dataset, identity, num_workers)
