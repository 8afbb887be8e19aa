"""How depctl writes JSON under a schema, as llguidance options and schema rewrites (no torch: the API layer builds
tool schemas with it)."""

from __future__ import annotations

# JSON as Python's json.dumps writes it: one space after ',' and ':', and nowhere else. Flexible whitespace lets a
# small model pad with newlines until max_tokens runs out, and fixed separators become forced, draftable tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# A number the schema leaves unbounded gets at most this many digits before and after its point, and no exponent:
# a small model that falls into repeating a digit would otherwise write it until max_tokens, and the JSON never ends.
# (llama.cpp's grammars cap both parts at 16; llguidance takes a multipleOf of at most 1e-10.) A schema's own
# minimum/maximum or multipleOf replaces the cap on that side.
INTEGER_DIGITS, FRACTION_DIGITS = 16, 10
_NUMERIC = {"number", "integer"}
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")

# any JSON object (``json_object``), spelled out so that its numbers are capped as well
ANY_OBJECT = {
    "$defs": {
        "value": {
            "anyOf": [
                {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
                {"type": "array", "items": {"$ref": "#/$defs/value"}},
                {"type": ["string", "number", "boolean", "null"]},
            ]
        }
    },
    "type": "object",
    "additionalProperties": {"$ref": "#/$defs/value"},
}


def cap_numbers(schema):
    """``schema`` with every number it allows held to INTEGER_DIGITS and FRACTION_DIGITS (a copy; the request's own
    schema is left as it came)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = cap_numbers(out[key])
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: cap_numbers(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [cap_numbers(sub) for sub in out[key]]
    types = out.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if types & _NUMERIC:
        bound = 10**INTEGER_DIGITS - 1
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -bound
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = bound
        if "integer" not in types and "multipleOf" not in out:
            out["multipleOf"] = 10.0**-FRACTION_DIGITS
    return out
