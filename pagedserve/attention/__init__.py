"""Paged attention backends behind one interface (see ``backend.py``)."""

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
