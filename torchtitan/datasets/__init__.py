"""Tokenizer, local text corpora with packing, and the resumable data-parallel dataloader."""

from torchtitan.datasets.dataloader import ParallelAwareDataloader, build_dataloader
from torchtitan.datasets.text_datasets import PackedTextDataset, build_text_dataset
from torchtitan.datasets.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "PackedTextDataset",
    "ParallelAwareDataloader",
    "Tokenizer",
    "build_dataloader",
    "build_text_dataset",
    "build_tokenizer",
]
