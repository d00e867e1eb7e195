"""`strict_json_schema`: the JSON schema a request's `json` constraint is compiled from — the client's schema with
vLLM's strictness (xgrammar's strict mode, its default backend) and a bound on integers.

* **No unlisted properties.** An object schema that lists `properties` or `patternProperties` and says nothing of
  `additionalProperties` (nor `unevaluatedProperties`) gets `additionalProperties: false`, at every nesting level:
  inside `properties`, `items`/`prefixItems`, `anyOf`/`oneOf` branches, `$defs`/`definitions`, `not`, `if`/`then`/
  `else` and the rest of the applicators. A schema that says `additionalProperties: true` or gives a sub-schema
  keeps its meaning. llguidance has no option for this (its `x-guidance` options are about whitespace, `oneOf`
  coercion, escapes and lenience), so the schema is rewritten. The direct members of an `allOf`, and a schema that
  has an `allOf`, are left open: their properties are merged, and closing each member would refuse the others'
  (the members' own nested schemas are still closed).
* **Integers have at most 18 digits.** An `integer` schema without a `minimum` (or `exclusiveMinimum`) gets
  `minimum: -(10**18 - 1)`, and without a maximum `maximum: 10**18 - 1`: inside the signed 64-bit range, and
  bounded, so a small model cannot write digits until `max_tokens`. (llguidance cannot build the exact 64-bit
  range: its bounds go through a double.)
* **Left as they are:** `number` (a bound on its magnitude would refuse values such as 6.02e23) and strings
  without `maxLength`: their length is bounded by `max_tokens` only, and an answer cut there ends with
  finish reason "length".
"""

from __future__ import annotations

import json
from typing import Any

INTEGER_LIMIT = 10**18 - 1
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
SCHEMA_KEYWORDS = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
                   "contains", "propertyNames", "not", "if", "then", "else")
SCHEMA_LIST_KEYWORDS = ("prefixItems", "anyOf", "oneOf", "allOf")
SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_json_schema(schema: dict[str, Any] | str) -> dict[str, Any]:
    """A strict copy of `schema` (a dict, or its JSON text); ValueError if the text is not a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"guided json is not a valid JSON schema: {err}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"guided json is not a valid JSON schema: a schema is an object, got "
                         f"{type(schema).__name__}")
    return _strict(schema, closable=True)


def _strict(schema: Any, closable: bool) -> Any:
    if not isinstance(schema, dict):
        return schema  # true / false, or a malformed value llguidance reports
    out = dict(schema)
    for key in SCHEMA_KEYWORDS:
        if key in out:
            value = out[key]
            out[key] = [_strict(s, True) for s in value] if isinstance(value, list) else _strict(value, True)
    for key in SCHEMA_LIST_KEYWORDS:
        if isinstance(out.get(key), list):
            out[key] = [_strict(s, key != "allOf") for s in out[key]]
    for key in SCHEMA_MAP_KEYWORDS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(s, True) for name, s in out[key].items()}
    lists_properties = "properties" in out or "patternProperties" in out
    if (closable and lists_properties and "allOf" not in out and "additionalProperties" not in out
            and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    if _is_integer(out):
        if "minimum" not in out and "exclusiveMinimum" not in out and _below(-INTEGER_LIMIT, out.get("maximum")):
            out["minimum"] = -INTEGER_LIMIT
        if "maximum" not in out and "exclusiveMaximum" not in out and _below(out.get("minimum"), INTEGER_LIMIT):
            out["maximum"] = INTEGER_LIMIT
    return out


def _is_integer(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "integer" or (isinstance(kind, list) and "integer" in kind and "number" not in kind)


def _below(low: Any, high: Any) -> bool:
    """False only when both are numbers and `low` is above `high` (an added bound would contradict the schema's)."""
    numbers = (int, float)
    if isinstance(low, numbers) and isinstance(high, numbers):
        return low <= high
    return True
