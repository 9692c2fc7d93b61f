"""A dependency's module that needs only the standard library, loaded without its package's `__init__`.

`import llama_cpp.llama_grammar` first runs `llama_cpp/__init__.py` (libllama, numpy, jinja2, the Llama class) and
`import gguf.constants` runs `gguf/__init__.py` (numpy and the whole writer): ~90 and ~105 ms, and tens of MiB, in a
server process that runs no model and wants one converter or one table. A leaf: it imports nothing of localllm."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

_LOCK = threading.Lock()  # Python's own imports lock per module; a server's worker threads resolve models at once
_LOADED: dict[str, ModuleType] = {}  # modules whose file ran to its end


def standalone(package: str, module: str) -> ModuleType:
    """`package.module`, loaded from its file under a private name where the package is not imported yet (a module
    loaded this way is not `sys.modules[package.module]`: its classes are its own); imported the usual way where
    the package already is, or where the file cannot be loaded alone."""
    full = f"{package}.{module}"
    with _LOCK:
        if full in _LOADED:
            return _LOADED[full]
        if package not in sys.modules:
            private = f"localllm._standalone.{full}"
            try:
                spec = importlib.util.find_spec(package)  # finds a top-level package without importing it
                folders = list(spec.submodule_search_locations or ()) if spec is not None else []
                found = importlib.util.spec_from_file_location(private, Path(folders[0]) / f"{module}.py")
                if found is not None and found.loader is not None:
                    loaded = importlib.util.module_from_spec(found)
                    sys.modules[private] = loaded  # dataclasses and enums look their module up while it runs
                    try:
                        found.loader.exec_module(loaded)
                    except BaseException:
                        del sys.modules[private]
                        raise
                    _LOADED[full] = loaded
                    return loaded
            except Exception:  # noqa: BLE001, S110 - the usual import below raises what is really wrong
                pass
    return importlib.import_module(full)
