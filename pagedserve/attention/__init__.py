"""Paged attention backends behind one interface (``backend.py``); ``selector.py`` picks
one by name and device."""

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
