"""The localhost HTTP server: one FastAPI app speaking the OpenAI, Ollama and llama.cpp dialects."""

from localllm.server.app import create_app

__all__ = ["create_app"]
