"""Datasets: SFT JSON lines -> tokenised examples -> batches (see sft.py, collate.py)."""
from .sft import DataError, build_datasets  # noqa: F401
