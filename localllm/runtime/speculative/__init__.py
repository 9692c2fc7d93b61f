"""Speculative decoding: verifying drafts with the target's sampler (verify.py), the drafters
(a draft model, prompt lookup) and drafting inside the engine's step."""
