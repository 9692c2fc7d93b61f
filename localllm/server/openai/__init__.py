"""OpenAI's dialect: chat and legacy completions, models, embeddings (chat.py), and the
Responses API (responses.py, its wire models in responses_wire.py)."""
