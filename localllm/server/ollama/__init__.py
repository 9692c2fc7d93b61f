"""Ollama's dialect: generate, chat and embed (generate.py), model management (manage.py),
blobs and create (blobs.py)."""
