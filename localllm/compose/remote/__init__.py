"""Remote models: requests built for an upstream server (requests.py) and the engine that
streams its answers back as Chunks (engine.py)."""
