"""The machine: what it has (RAM, GPUs, CPU features) and how a model fits on it."""
