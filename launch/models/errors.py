"""The loader's one error type, shared by the checkpoint loader and the quantized formats it reads, and the
JSON files of a checkpoint read with it (`json_object`)."""
from __future__ import annotations

import json
from typing import Any, Dict

from .common import one_line

__all__ = ["CheckpointError", "json_object"]


class CheckpointError(ValueError):
    """A checkpoint this loader cannot load; the message names the folder, file or tensor."""


def json_object(file: str) -> Dict[str, Any]:
    """The JSON object ``file`` holds; `CheckpointError` naming it where it is not readable JSON or not an object."""
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{file}: not readable JSON ({one_line(e)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: holds {type(data).__name__}, not a JSON object")
    return data
