"""The llama.cpp boundary: ctypes over llama-cpp-python's bindings (llama.py), devices, RPC workers,
the AMX guard, and the embedding context."""
