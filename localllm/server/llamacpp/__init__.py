"""llama.cpp's own server dialect: /completion and /infill and the token endpoints
(completion.py), the server's state (info.py), the prompt forms it takes (prompts.py)."""
