"""The prompt cache: which cached prefix a prompt may reuse (prefix.py), parked sequence states
in RAM (parking.py) and on disk (disk.py)."""
