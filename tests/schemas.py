"""A JSON schema with every feature the structured-output tests and
benchmarks exercise (nested objects, arrays, enum, integer and string bounds,
a pattern, `$ref`, `additionalProperties: false`), small enough that a random
model completes it within a few dozen tokens, and a valid instance. Data
only: bench/ imports it before mlx is loaded."""

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "home": {"$ref": "#/$defs/home"},
    },
    "required": ["name", "age", "kind", "tags", "home"],
    "additionalProperties": False,
    "$defs": {
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        }
    },
}

PET_VALUE = {"name": "Biscuit", "age": 7, "kind": "dog", "tags": ["loyal", "loud"], "home": {"city": "Lisbon", "zip": 10021}}
