"""Chat fine-tuning data: conversations tokenized with the checkpoint's chat template, packed, only replies trained.

Each conversation becomes its rendered text's tokens and, per token, whether it is a target: the tokens of the
assistant's replies (chat_format.py) are, every other token (system and user turns, the template's scaffolding) is
not, so its label is IGNORE_INDEX and the loss (a mean over non-ignored labels) never sees it. Nothing is added to the
rendered text: a template that writes BOS gets it once.

Packing: conversations in file order fill sequences of seq_len + 1 tokens, a conversation that does not fit the rest
of one starting the next; the tail is padding (EOS ids, never trained). Each conversation, and the padding, has its own
document id, so `--model.attn_mask_type block_causal` keeps them apart and MTP never predicts across one: a packed
conversation trains exactly as it would alone. A conversation longer than seq_len + 1 is refused, or cut to it with
`training.chat_truncate`.

The packed sequences repeat epoch after epoch in the same order; sample i is sequence i % count. Data-parallel split,
loader workers and resume are the text path's (`PackedTextDataset`: the state is the samples yielded).
"""

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.chat_format import ChatTemplate, chat_files, conversation
from torchtitan.datasets.corpus import DatasetError, iter_records
from torchtitan.datasets.text_datasets import PackedTextDataset, SplitLayout
from torchtitan.datasets.tokenizer import Tokenizer

IGNORE_INDEX = -100
"""components/loss.py's label to ignore (a layer this package may not import; a test keeps the two equal)."""

_BATCH = 256  # conversations rendered, then tokenized together

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Conversation:
    tokens: np.ndarray  # (n,) int64: the rendered conversation's tokens
    trained: np.ndarray  # (n,) bool: token k is a target (the label of position k - 1 is trained)


def tokenize_conversations(
    files: list[Path], template: ChatTemplate, tokenizer: Tokenizer, max_tokens: int, truncate: bool
) -> tuple[list[Conversation], int]:
    """The conversations of `files` in order, and how many were dropped for training nothing (no assistant reply, or
    none left after truncation). Longer than `max_tokens`: cut with `truncate`, else an error naming the record."""
    conversations, dropped, pending = [], 0, []

    def flush() -> None:
        nonlocal dropped
        rendered = [template.render_chat(messages, where) for messages, where in pending]
        encoded = tokenizer.encode_batch_with_offsets([chat.text for chat in rendered])
        for (_, where), chat, (ids, offsets) in zip(pending, rendered, encoded, strict=True):
            tokens, trained = np.asarray(ids, np.int64), _trained_tokens(offsets, chat.assistant_spans)
            if len(tokens) > max_tokens:
                if not truncate:
                    raise DatasetError(
                        f"{where}: the conversation is {len(tokens):,} tokens, longer than a sequence "
                        f"(training.seq_len + 1 = {max_tokens:,}); raise --training.seq_len, or pass "
                        "--training.chat_truncate to cut such conversations (their tails are not trained)"
                    )
                tokens, trained = tokens[:max_tokens], trained[:max_tokens]
            if trained.any():
                conversations.append(Conversation(tokens, trained))
            else:
                dropped += 1
        pending.clear()

    for file in files:
        for index, record in enumerate(iter_records(file)):
            where = f"{file} record {index}"
            pending.append((conversation(record, where), where))
            if len(pending) == _BATCH:
                flush()
    flush()
    return conversations, dropped


def _trained_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """Per token: does it start inside an assistant span? The first token never is (nothing predicts it)."""
    starts = np.array([start for start, _ in offsets], np.int64)
    trained = np.zeros(len(offsets), bool)
    for start, end in spans:
        trained |= (starts >= start) & (starts < end)
    trained[:1] = False
    return trained


class ChatPacks:
    """Conversations packed into sequences of `sample_tokens` tokens, in order; sample i is sequence i % count."""

    def __init__(self, conversations: list[Conversation], sample_tokens: int, pad_id: int, name: str):
        if not conversations:
            raise DatasetError(f"{name}: no conversation with an assistant reply to train on")
        self.name = name
        self.sample_tokens = sample_tokens
        self.pad_id = pad_id
        self.conversations = conversations
        self.packs: list[list[int]] = [[]]  # each sequence's conversations (indices)
        filled = 0
        for index, chat in enumerate(conversations):
            if filled + len(chat.tokens) > sample_tokens:
                self.packs.append([])
                filled = 0
            self.packs[-1].append(index)
            filled += len(chat.tokens)
        trained = [sum(int(conversations[i].trained[1:].sum()) for i in pack) for pack in self.packs]
        self.trained_cumulative = np.concatenate([[0], np.cumsum(trained)]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.packs)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int64, document ids int32, trained bool) of sample `index`, each (sample_tokens,)."""
        tokens = np.full(self.sample_tokens, self.pad_id, np.int64)
        document_ids = np.empty(self.sample_tokens, np.int32)
        trained = np.zeros(self.sample_tokens, bool)
        filled = 0
        pack = self.packs[index % len(self.packs)]
        for document, chat_index in enumerate(pack, start=1):
            chat = self.conversations[chat_index]
            end = filled + len(chat.tokens)
            tokens[filled:end], trained[filled:end], document_ids[filled:end] = chat.tokens, chat.trained, document
            filled = end
        document_ids[filled:] = len(pack) + 1  # the padding is a document of its own
        return tokens, document_ids, trained

    def trained_tokens(self, num_samples: int) -> int:
        """Labels trained (not IGNORE_INDEX) over the first `num_samples` global samples."""
        epochs, within = divmod(num_samples, len(self.packs))
        return int(epochs * self.trained_cumulative[-1] + self.trained_cumulative[within])

    def fingerprint(self) -> str:
        """A hash of every sequence: the tokens, their targets and the packing."""
        digest = hashlib.sha256()
        for index in range(len(self.packs)):
            for array in self.sample(index):
                digest.update(array.tobytes())
        return digest.hexdigest()[:16]


class PackedChatDataset(PackedTextDataset):
    """`PackedTextDataset` over packed conversations: the same samples, split and state, with the labels of every
    token but the replies' set to IGNORE_INDEX."""

    def __iter__(self):
        while True:
            tokens, document_ids, trained = self.mixture.sample(self._global_sample_index(self._samples_yielded))
            self._samples_yielded += 1
            window = torch.from_numpy(tokens)
            labels = window[1:].masked_fill(~torch.from_numpy(trained[1:]), IGNORE_INDEX)
            yield {"input": window[:-1], "document_ids": torch.from_numpy(document_ids)}, labels

    def trained_tokens(self, num_samples: int) -> int:
        """Labels trained over the first `num_samples` global samples (all ranks)."""
        return self.mixture.trained_tokens(num_samples)


def build_chat_dataset(
    job_config: JobConfig, tokenizer: Tokenizer, vocab_size: int, layout: SplitLayout
) -> tuple[PackedChatDataset, dict[str, Any]]:
    """The packed chat dataset of `layout`'s split for its rank and its identity (as `build_text_dataset`'s).
    Validation without a dataset_path of its own holds the last 1/20 of the conversations out of training."""
    training, validation = job_config.training, job_config.validation
    split, seq_len = layout.split, layout.seq_len
    own_validation = split == "validation" and validation.dataset_path is not None
    path = validation.dataset_path if own_validation else training.dataset_path
    files = chat_files(path, "validation" if own_validation else "training")
    template = ChatTemplate(tokenizer.path)
    conversations, dropped = tokenize_conversations(files, template, tokenizer, seq_len + 1, training.chat_truncate)
    if validation.enable and validation.dataset_path is None:
        held_out = max(len(conversations) // 20, 1)
        if len(conversations) < 2:
            raise DatasetError(
                f"--training.dataset_path={path!r} holds {len(conversations)} conversation to train on, none to hold "
                "out for validation; give --validation.dataset_path"
            )
        cut = len(conversations) - held_out
        conversations = conversations[cut:] if split == "validation" else conversations[:cut]
    too_large = [int(t) for chat in conversations for t in chat.tokens[chat.tokens >= vocab_size][:1]]
    if too_large:
        raise DatasetError(
            f"{path}: the tokenizer {tokenizer.path} gives id {too_large[0]}, past the model's vocabulary of "
            f"{vocab_size:,}; pass the checkpoint's tokenizer as --model.tokenizer_path"
        )
    packs = ChatPacks(conversations, seq_len + 1, tokenizer.eos_id, str(path))
    trained = int(packs.trained_cumulative[-1])
    logger.info(
        f"{split} chat data: {len(conversations):,} conversations ({dropped:,} without a reply to train skipped) in "
        f"{len(packs):,} sequences of {seq_len + 1} tokens, {trained:,} tokens trained "
        f"({trained / (len(packs) * seq_len):.1%} of the labels)"
    )
    if split == "validation" and (needed := validation.steps * layout.samples_per_step) > len(packs):
        raise DatasetError(
            f"validation.steps={validation.steps} needs {needed:,} sequences of chat data, more than the validation "
            f"conversations fill ({len(packs):,}): lower --validation.steps, or give a larger --validation.dataset_path"
        )
    identity = {
        "dataset": [str(path)],
        "data_sha256": packs.fingerprint(),
        "num_documents": len(conversations),
        "num_tokens": int(sum(len(chat.tokens) for chat in conversations)),
        "tokenizer": tokenizer.fingerprint,
        **layout.identity(),
    }
    return PackedChatDataset(packs, layout), identity
