"""Measurements an engine keeps for the next one on the same model and settings (in the disk tier's folder): the
state copy rates (cache/parking.py CopyCost) and the decode cost by batch rows (speculative/verify.py StepCost).

A restarted engine starts from them instead of measuring again before its first request. They are hints, not
data: unreadable, damaged or absent, they are measured afresh, and a folder gone read-only costs the hint only."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    """The saved value, or None where there is none or it does not parse."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, value: Any) -> None:
    """Written atomically (a reader sees the old file or the new one); an OSError is swallowed. The temporary's name
    ends in this process's pid and `.tmp`, as the disk tier's (DiskStates sweeps those whose writer is gone), and
    carries the thread: two engines on one folder do not write into one temporary."""
    tmp = path.with_name(f"{path.name}.{threading.get_ident()}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:
        pass
