"""Anthropic's Messages API: the routes and rendering (messages.py), its wire models (wire.py)."""
