"""Model files: find a model, read its config and stream its weights with Hugging Face
names (``files.py``: Hugging Face directories; ``gguf_file.py``: GGUF files). Knows file
formats, not architectures: the worker builds a model (``models/registry.py``) and feeds it
these weights."""
