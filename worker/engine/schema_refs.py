"""JSON schemas whose `$ref`s loop with no way out, so that no JSON value
matches them: `{"$ref": "#"}`, two `$defs` naming each other, an object that
requires a property of its own type. llguidance compiles such a schema into
a grammar that allows nothing but the end, and the reply would be empty
with finish_reason `stop`; the pool refuses it as a bad request instead.

Recursion with a way out stays allowed: a tree whose children are an
optional property or a possibly empty array, a `null` branch, an `anyOf`
with a plain alternative.

The check is the productivity test of a context-free grammar, done once
over the schema in linear time (a worklist, no recursion, so a hostile
schema nested or chained deeply costs no stack): a subschema can match some
value once every `$ref`, `allOf` member and required property or item it
needs can, and one member of each `anyOf`/`oneOf`. Everything else (types,
formats, `not`, `if`) is taken as satisfiable; llguidance judges those.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

_LEAF_TYPES = frozenset({"string", "number", "integer", "boolean", "null"})

# Nesting of subschemas once `$ref`s are followed. The decoders refuse JSON
# nested about a thousand deep, but a chain of `$defs` each naming the next
# nests as deep as 256 KiB of them go: llguidance recurses over it, and its
# thread's stack overflowed (the worker died of SIGSEGV) at 2,500 chained
# refs, or 1,600 objects that each require the next. Real schemas nest a
# few dozen deep.
MAX_SCHEMA_DEPTH = 1000


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#", "#/$defs/a") names; None when it is
    not a local JSON pointer or names nothing (llguidance reports those)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _structural(schema: dict) -> bool:
    """Whether the schema only admits objects or arrays, so that its required
    properties and items must exist; with no `type`, or a leaf type among
    them, a scalar matches whatever those say."""
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    return bool(kinds) and not (kinds & _LEAF_TYPES)


def _needs(schema: dict, root: Any) -> tuple[list[Any], list[list[Any]]]:
    """What `schema` needs to match anything: subschemas that must all be
    satisfiable, and groups of which one member must be."""
    every: list[Any] = []
    groups: list[list[Any]] = []
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _pointer(root, ref)
        if target is not None:
            every.append(target)
    all_of = schema.get("allOf")
    if isinstance(all_of, list):
        every.extend(all_of)
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list) and members:
            groups.append(members)
    if _structural(schema):
        props = schema.get("properties")
        required = schema.get("required")
        if isinstance(props, dict) and isinstance(required, list):
            every.extend(props[name] for name in required if isinstance(name, str) and name in props)
        min_items = schema.get("minItems")
        if isinstance(min_items, int) and min_items > 0:
            prefix = schema.get("prefixItems")
            prefix = prefix if isinstance(prefix, list) else []
            every.extend(prefix[:min_items])
            if min_items > len(prefix) and "items" in schema:
                every.append(schema["items"])
    return every, groups


def unmatchable_ref(root: Any) -> str | None:
    """None when the schema's `$ref`s leave some value to match; else the
    first `$ref` (by where it sits in the schema) on a loop with no way out."""
    # Every dict in the schema is a node (a `$ref` may point anywhere); ids
    # keep the walk linear and a dict named twice is still one node.
    nodes: dict[int, tuple[dict, str]] = {}
    stack: list[tuple[Any, str]] = [(root, "#")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            if id(value) in nodes:
                continue
            nodes[id(value)] = (value, where)
            stack.extend((v, f"{where}/{k}") for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}/{i}") for i, v in enumerate(value))
    if not any(isinstance(s.get("$ref"), str) for s, _ in nodes.values()):
        return None

    # Horn-clause propagation: `waiting[n]` counts what n still needs; a
    # node at zero can match a value and tells the nodes that need it.
    waiting: dict[int, int] = {}
    needed_by: dict[int, list[tuple[int, int | None]]] = {}  # dep -> (node, group index or None)
    groups_met: dict[int, set[int]] = {}
    ready: list[int] = []
    for key, (schema, _) in nodes.items():
        every, groups = _needs(schema, root)
        count = 0
        for dep in every:
            if isinstance(dep, dict):  # a boolean schema or other value: llguidance's to judge
                needed_by.setdefault(id(dep), []).append((key, None))
                count += 1
        for g, members in enumerate(groups):
            if all(isinstance(m, dict) for m in members):
                for m in members:
                    needed_by.setdefault(id(m), []).append((key, g))
                count += 1
        waiting[key] = count
        groups_met[key] = set()
        if count == 0:
            ready.append(key)
    matchable: set[int] = set()
    while ready:
        key = ready.pop()
        if key in matchable:
            continue
        matchable.add(key)
        for node, group in needed_by.get(key, ()):
            if group is not None:
                if group in groups_met[node]:
                    continue
                groups_met[node].add(group)
            waiting[node] -= 1
            if waiting[node] == 0:
                ready.append(node)
    if not isinstance(root, dict) or id(root) in matchable:
        return None
    # A `$ref` that cannot match, whose target cannot either: on the loop.
    stuck = [
        (where, schema["$ref"])
        for key, (schema, where) in nodes.items()
        if key not in matchable
        and isinstance(schema.get("$ref"), str)
        and isinstance(_pointer(root, schema["$ref"]), dict)
        and id(_pointer(root, schema["$ref"])) not in matchable
    ]
    where, ref = min(stuck, key=lambda s: (len(s[0]), s[0])) if stuck else ("#", "#")
    return f'the "$ref" {ref!r} at {where} loops back with no way out: no JSON value can match the schema'


def _subschemas(schema: dict, root: Any) -> list[dict]:
    """The dicts directly inside `schema` (through lists too) and the one its
    local `$ref` names."""
    found: list[dict] = []
    pending: list[Any] = list(schema.values())
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            found.append(value)
        elif isinstance(value, list):
            pending.extend(value)
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _pointer(root, ref)
        if isinstance(target, dict):
            found.append(target)
    return found


def too_deep(root: Any, limit: int = MAX_SCHEMA_DEPTH) -> str | None:
    """None when the schema nests at most `limit` subschemas deep with its
    `$ref`s followed (a `$ref` back to a subschema it sits in is recursion,
    which llguidance keeps as one rule, so it adds no depth); else why not."""
    if not isinstance(root, dict):
        return None
    depth: dict[int, int] = {}  # finished nodes: how deep they nest
    on_path: set[int] = {id(root)}
    best: dict[int, int] = {id(root): 0}
    stack = [(root, iter(_subschemas(root, root)))]
    refused = f'the JSON schema nests more than {limit} subschemas deep once its "$ref"s are followed'
    while stack:
        node, kids = stack[-1]
        kid = next(kids, None)
        if kid is None:
            stack.pop()
            on_path.discard(id(node))
            depth[id(node)] = best[id(node)] + 1
            if depth[id(node)] > limit:
                return refused
            if stack:
                parent = id(stack[-1][0])
                best[parent] = max(best[parent], depth[id(node)])
        elif id(kid) in depth:
            best[id(node)] = max(best[id(node)], depth[id(kid)])
        elif id(kid) not in on_path:
            if len(stack) >= limit:
                return refused
            on_path.add(id(kid))
            best[id(kid)] = 0
            stack.append((kid, iter(_subschemas(kid, root))))
    return None
