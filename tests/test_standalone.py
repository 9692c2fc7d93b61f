"""localllm/standalone.py: a dependency's stdlib-only module loaded without its package's init."""

from __future__ import annotations

import subprocess
import sys

RACE = """
import sys, threading
from localllm.standalone import standalone
barrier, errors = threading.Barrier(8), []

def use():
    barrier.wait()
    try:
        standalone("gguf", "constants").GGML_QUANT_SIZES
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=use) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("ERRORS", errors, "gguf" in sys.modules)
"""


def test_threads_loading_one_module_at_once_all_get_it_whole() -> None:
    """A server's worker threads resolve models at once after a start. The loader put the module in sys.modules
    before its file had run, and a second thread took it half made (AttributeError: no GGML_QUANT_SIZES, 2 runs
    in 6). Now one thread loads it and the others wait."""
    for _ in range(6):
        out = subprocess.run([sys.executable, "-c", RACE], check=False, capture_output=True, text=True, timeout=60)
        assert "ERRORS [] False" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_module_of_a_package_already_imported_is_the_package_own() -> None:
    code = ("import gguf.constants\nfrom localllm.standalone import standalone\n"
            "print('SAME', standalone('gguf', 'constants') is gguf.constants)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert "SAME True" in out.stdout, out.stdout + out.stderr[-2000:]
