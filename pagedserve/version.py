"""The package version (``pyproject.toml``'s), importable from any room without importing
the package's public facade (``pagedserve/__init__.py``)."""

__version__ = "0.1.0"
