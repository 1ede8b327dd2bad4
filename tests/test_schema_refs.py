"""JSON schemas refused before llguidance compiles them: `$ref` loops no
value can get out of, and `$ref` chains deeper than its stack. Recursion
with a way out is left alone."""

from __future__ import annotations

import pytest

from worker.engine.schema_refs import MAX_SCHEMA_DEPTH, too_deep, unmatchable_ref

LOOPS = {
    "itself": {"$ref": "#"},
    "two defs": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    "legacy definitions": {
        "type": "object",
        "properties": {"x": {"$ref": "#/definitions/a"}},
        "required": ["x"],
        "definitions": {"a": {"$ref": "#/definitions/a"}},
    },
    "allOf": {"allOf": [{"type": "string"}, {"$ref": "#"}]},
    "anyOf of loops only": {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]},
    "a required property": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    "a non-empty array": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "a required prefix item": {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
    "an escaped pointer": {"$ref": "#/$defs/a~1b", "$defs": {"a/b": {"$ref": "#/$defs/a~1b"}}},
}

WAYS_OUT = {
    "no refs": {"type": "object", "properties": {"a": {"type": "string"}}},
    "a tree": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    "an optional property": {"type": "object", "properties": {"next": {"$ref": "#"}}},
    "an anyOf alternative": {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
    "a null type": {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    "no type: a scalar matches": {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    "a loop in unused defs": {"type": "string", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "a remote ref (llguidance's to judge)": {"$ref": "https://example.com/schema.json"},
    "a missing def (llguidance names it)": {"$ref": "#/$defs/gone"},
    "a linked list": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                "required": ["v", "next"],
            }
        },
        "$ref": "#/$defs/node",
    },
}


@pytest.mark.parametrize("name", LOOPS)
def test_loops_with_no_way_out_are_found(name):
    assert "loops back with no way out" in unmatchable_ref(LOOPS[name])


@pytest.mark.parametrize("name", WAYS_OUT)
def test_recursion_with_a_way_out_is_not(name):
    assert unmatchable_ref(WAYS_OUT[name]) is None and too_deep(WAYS_OUT[name]) is None


def test_the_reported_ref_is_on_the_loop():
    assert unmatchable_ref(LOOPS["a required property"]).startswith("the \"$ref\" '#' at #/properties/next")


def chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def test_ref_chains_are_bounded_in_depth_whatever_the_order_of_the_defs():
    assert too_deep(chain(MAX_SCHEMA_DEPTH - 10)) is None
    assert "nests more than 1000 subschemas deep" in too_deep(chain(MAX_SCHEMA_DEPTH))
    reversed_defs = chain(3 * MAX_SCHEMA_DEPTH)
    reversed_defs["$defs"] = dict(reversed(list(reversed_defs["$defs"].items())))
    assert too_deep(reversed_defs) is not None and too_deep(chain(3 * MAX_SCHEMA_DEPTH)) is not None
    # Objects that each hold the next: three subschemas a level.
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(400)}
    defs["d400"] = {"type": "string"}
    assert too_deep({"$ref": "#/$defs/d0", "$defs": defs}) is not None


def test_a_long_loop_costs_no_stack():
    n = 5_000  # deeper than Python's recursion limit
    defs = {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % n}"} for i in range(n)}
    assert unmatchable_ref({"$ref": "#/$defs/d0", "$defs": defs}) is not None
