"""Composition: a model name becomes a ModelSpec, engine settings, a chat format and a Request."""
