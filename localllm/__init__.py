"""localllm: run GGUF language models on the machine in front of you."""

__version__ = "0.1.0"
