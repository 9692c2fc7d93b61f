"""A model's engine in a child process: the host side (host.py), the child (child.py) and the
wire between them (protocol.py)."""
