"""Datasets, tokenizers and the shipped synthetic task."""

from areal_fast.data.datasets import PromptRow, PromptStream, build_prompts, load_split, read_rows
from areal_fast.data.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

__all__ = ["CharTokenizer", "HFTokenizer", "PromptRow", "PromptStream", "build_prompts", "load_split",
           "load_tokenizer", "read_rows"]
