"""The engine: one model, one llama context with N slots, one scheduler thread (scheduler.py);
per-slot state, streams, context shifts, llama-server's prefill cuts, sampler chains and
token probabilities."""
