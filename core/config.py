"""Reading the parsed config (jsonargparse Namespaces, dicts, ``class_path`` + ``init_args`` nodes) without
instantiating anything."""

from __future__ import annotations

from typing import Any


def get(node: Any, *keys: str, default: Any = None) -> Any:
    """``node.a.b`` through Namespaces/dicts, trying ``init_args`` on the way; ``default`` when any is missing."""
    for key in keys:
        if node is None:
            return default
        value = node.get(key) if hasattr(node, "get") else getattr(node, key, None)
        if value is None and hasattr(node, "get") and node.get("init_args") is not None:
            value = node["init_args"].get(key)
        node = value
    return default if node is None else node
