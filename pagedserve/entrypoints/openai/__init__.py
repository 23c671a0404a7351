"""The OpenAI-compatible HTTP server: protocol models, handlers and the FastAPI app."""
