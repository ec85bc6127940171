"""Tokenizer, local text corpora with packing, and the resumable data-parallel dataloader."""
