"""A lower bound on the characters a constraint's output needs, so that a request whose
``max_tokens`` cannot hold any valid output is refused up front instead of running to a
truncated, invalid answer.

The bound is exact for the obvious cases (``minLength``, ``minItems``, required properties,
``const`` and ``enum``, a regex's fixed parts, the shortest choice) and 0 where it cannot be
read cheaply (a Lark grammar, a recursive ``$ref``), so it never refuses a request that could
finish.
"""

from __future__ import annotations

import json
import re
from typing import Any

from specbatch.sampling_params import StructuredOutputsParams

_SCALARS = {"null": 4, "boolean": 4, "integer": 1, "number": 1, "string": 2, "array": 2}
_DEPTH = 32  # nesting followed before giving up (the bound only loses precision)


def shortest_output(params: StructuredOutputsParams) -> int:
    """Fewest characters any output satisfying ``params`` has (JSON written with ``", "`` and
    ``": "`` separators, as the grammar writes it)."""
    kind = params.kind
    if kind == "choice":
        return min(len(choice) for choice in params.choice or [""])
    if kind == "json_object":
        return 2
    if kind == "json":
        value = params.json
        schema: dict[str, Any] = json.loads(value) if isinstance(value, str) else value or {}
        return _json_chars(schema, schema, _DEPTH)
    if kind == "regex":
        return _regex_chars(str(params.regex))
    return 0


def _regex_chars(pattern: str) -> int:
    # The stdlib parser agrees with llguidance's regex syntax on what both accept; where it
    # does not parse the pattern the bound is 0.
    try:
        import re._parser as parser  # private, but stable since 3.11

        return int(min(parser.parse(pattern).getwidth()[0], 2**31))
    except (re.error, ImportError, RecursionError, ValueError, OverflowError):
        return 0


def _json_chars(schema: Any, root: dict[str, Any], depth: int) -> int:
    if depth <= 0 or not isinstance(schema, dict):
        return 1 if schema is not False else 0
    if "$ref" in schema:
        target = _resolve(root, schema["$ref"])
        return 0 if target is None else _json_chars(target, root, depth - 1)
    if "const" in schema:
        return _written(schema["const"])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(_written(value) for value in schema["enum"])
    bounds = []
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            bounds.append(min(_json_chars(s, root, depth - 1) for s in schema[key]))
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        bounds.append(max(_json_chars(s, root, depth - 1) for s in schema["allOf"]))
    kinds = schema.get("type")
    if isinstance(kinds, str):
        kinds = [kinds]
    if isinstance(kinds, list) and kinds:
        bounds.append(min(_typed_chars(schema, str(kind), root, depth) for kind in kinds))
    return max(bounds, default=1)


def _typed_chars(schema: dict[str, Any], kind: str, root: dict[str, Any], depth: int) -> int:
    if kind == "string":
        return 2 + _count(schema.get("minLength"))
    if kind == "array":
        items = _count(schema.get("minItems"))
        if not items:
            return 2
        item = _json_chars(schema.get("items", {}), root, depth - 1)
        return 2 + items * item + 2 * (items - 1)
    if kind == "object":
        required = schema.get("required")
        listed = schema.get("properties")
        properties: dict[str, Any] = listed if isinstance(listed, dict) else {}
        names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
        fields = [
            len(json.dumps(name)) + 2 + _json_chars(properties.get(name, {}), root, depth - 1)
            for name in names
        ]
        return 2 + sum(fields) + 2 * max(len(fields) - 1, 0)
    return _SCALARS.get(kind, 1)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _written(value: Any) -> int:
    return len(json.dumps(value, separators=(", ", ": "), ensure_ascii=False))


def _resolve(root: dict[str, Any], ref: Any) -> Any:
    """A local ``#/...`` reference's target (None for anything else)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
