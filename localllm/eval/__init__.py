"""Evaluation against llama.cpp itself: the fresh-context reference and its near-tie tolerance
(reference.py), llama-cpp-python's Llama class as a baseline, perplexity."""
