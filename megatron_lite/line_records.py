"""Reading a JSON-lines file that a killed writer may have cut short: every whole object line, in order."""
from __future__ import annotations

import json
from typing import Any, Dict, List


def read_json_lines(path: str) -> List[Dict[str, Any]]:
    """The JSON objects of `path`, one per line; a line that does not parse (cut short) or is not an object is
    skipped. A missing file has none."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    items = []
    for line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict):
            items.append(item)
    return items
