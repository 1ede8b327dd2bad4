"""Tool calls in the text a model writes, per model family, and the Lark
grammar (for llguidance) that holds a forced call to that family's form.

Each family's chat template tells its model how to call a tool; the reply
comes back in the same form, which `parse` reads into OpenAI's
(name, arguments-as-JSON) pairs:

| format | what the model writes | models |
|---|---|---|
| `qwen3` | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call | Qwen2.5, Qwen3, QwQ, Hermes, the demo model |
| `qwen3_coder` | `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>` | Qwen3-Coder, Qwen3-Next, Qwen3.5 |
| `llama3_json` | `{"name": ..., "parameters": {...}}` (optionally after `<\\|python_tag\\|>`, several joined by `;`) | Llama 3.1, 3.2, 3.3 |
| `mistral` | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]NAME[ARGS]{...}` | Mistral 7B v0.3, Nemo, Small, Magistral |
| `gemma` | `[name(a=1, b="x")]` Python calls, optionally in a ```` ```tool_code ```` fence | Gemma 3 |
| `deepseek` | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...` (V3, R1), or `NAME<｜tool▁sep｜>{...}` (V3.1) | DeepSeek V3, R1, V3.1 |

`detect` picks the format from the chat template's text; a `[[models]]`
entry's `tool_parser` overrides it. A reply that does not parse is text:
the caller returns it as `content`, never an error.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

# Calls one forced reply may make with parallel_tool_calls: a model that
# keeps calling must still end its reply within a bound.
MAX_CALLS = 8

FORMATS = ("qwen3", "qwen3_coder", "llama3_json", "mistral", "gemma", "deepseek")

_json = json.JSONDecoder()


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as OpenAI's `function.arguments`


def detect(template: str | None) -> str:
    """The tool-call format a chat template teaches its model."""
    t = template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "qwen3"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "tool▁call" in t:
        return "deepseek"
    if "<|python_tag|>" in t or "<|start_header_id|>" in t:
        return "llama3_json"
    if "tool_code" in t or "<start_of_turn>" in t:
        return "gemma"
    return "qwen3"


def _args_json(value: object) -> str | None:
    """A call's arguments as OpenAI carries them: a JSON object's text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if value is None:
        value = {}
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call_of(obj: object, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = _args_json(obj[key] if key else {})
    return None if args is None else Call(obj["name"], args)


def _json_values(text: str, separators: str) -> list[object] | None:
    """Consecutive JSON values in `text`, apart by whitespace or `separators`."""
    out, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return out
        try:
            value, i = _json.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


# -- one parser per format; each returns (content, calls) or None ---------------------


_QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


def _qwen3(text: str, params: dict) -> tuple[str, list[Call]] | None:
    start = text.find("<tool_call>")
    calls = []
    for body in _QWEN_CALL.findall(text, start):
        values = _json_values(body, "")
        if not values or len(values) != 1:
            return None
        call = _call_of(values[0])
        if call is None:
            return None
        calls.append(call)
    return text[:start].strip(), calls


_CODER_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|\Z)", re.S)
_CODER_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _coder_value(raw: str, schema: dict) -> object:
    """A parameter's text as the type its schema gives (text when unsure)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return raw
    if raw.strip().lower() in ("null", "none") and kind != "string":
        return None
    if kind == "boolean":
        return raw.strip().lower() == "true" if raw.strip().lower() in ("true", "false") else raw
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return raw


def _qwen3_coder(text: str, params: dict) -> tuple[str, list[Call]] | None:
    start = text.find("<tool_call>")
    calls = []
    blocks = list(_CODER_CALL.finditer(text, start))
    if not blocks or text.count("<tool_call>") != len(blocks):
        return None
    for block in blocks:
        name = block.group(1).strip()
        schema = (params.get(name) or {}).get("properties") or {}
        args = {k.strip(): _coder_value(v, schema.get(k.strip()) or {}) for k, v in _CODER_PARAM.findall(block.group(2))}
        calls.append(Call(name, json.dumps(args, ensure_ascii=False)))
    return text[:start].strip(), calls


def _llama3_json(text: str, params: dict) -> tuple[str, list[Call]] | None:
    body = text.strip().removeprefix("<|python_tag|>")
    values = _json_values(body, ";")
    if not values:
        return None
    calls = [_call_of(v, ("parameters", "arguments")) for v in values]
    return None if None in calls else ("", calls)  # type: ignore[return-value]


_MISTRAL_NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\][A-Za-z0-9]+)?\s*\[ARGS\]")


def _mistral(text: str, params: dict) -> tuple[str, list[Call]] | None:
    start = text.find("[TOOL_CALLS]")
    rest = text[start:]
    calls: list[Call] = []
    if _MISTRAL_NAMED.match(rest):
        # [TOOL_CALLS]name[ARGS]{...}, repeated (v11 tokenizers and later).
        i = 0
        while i < len(rest):
            named = _MISTRAL_NAMED.match(rest, i)
            if named is None:
                if rest[i:].strip():
                    return None
                break
            try:
                args, i = _json.raw_decode(rest, named.end())
            except ValueError:
                return None
            call = _call_of({"name": named.group(1), "arguments": args})
            if call is None:
                return None
            calls.append(call)
            while i < len(rest) and rest[i].isspace():
                i += 1
    else:
        values = _json_values(rest[len("[TOOL_CALLS]") :], "")
        if not values:
            return None
        for value in values:
            for item in value if isinstance(value, list) else [value]:
                call = _call_of(item)
                if call is None:
                    return None
                calls.append(call)
    return text[:start].strip(), calls


_FENCE = re.compile(r"^```(?:tool_code|python)?\s*\n?(.*?)\n?```$", re.S)
_PY_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _py_value(node: ast.expr) -> object:
    if isinstance(node, ast.Name) and node.id in _PY_NAMES:
        return _PY_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)


def _gemma(text: str, params: dict) -> tuple[str, list[Call]] | None:
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    if len(body) > 1 << 20:
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)) or node.args:
            return None
        name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
        try:
            args = {kw.arg: _py_value(kw.value) for kw in node.keywords if kw.arg is not None}
            calls.append(Call(name, json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return ("", calls) if calls else None


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_V3 = re.compile(r"(?:function)?" + DS_SEP + r"([^\n]+)\n```(?:json)?\n(.*?)\n```\s*$", re.S)
_DS_V31 = re.compile(r"([^<\n]+?)" + DS_SEP + r"(.*)$", re.S)


def _deepseek(text: str, params: dict) -> tuple[str, list[Call]] | None:
    start = text.find(DS_BEGIN)
    body = text[start + len(DS_BEGIN) :]
    body = body.split(DS_END, 1)[0]
    calls = []
    for part in body.split(DS_CALL)[1:]:
        part = part.split(DS_CALL_END, 1)[0].strip()
        found = _DS_V3.match(part) or _DS_V31.match(part)
        if found is None:
            return None
        call = _call_of({"name": found.group(1).strip(), "arguments": found.group(2).strip()})
        if call is None:
            return None
        calls.append(call)
    return (text[:start].strip(), calls) if calls else None


_PARSERS = {"qwen3": _qwen3, "qwen3_coder": _qwen3_coder, "llama3_json": _llama3_json, "mistral": _mistral, "gemma": _gemma, "deepseek": _deepseek}

# Where a call may begin: anywhere (MARKERS), or only at the start of the
# answer (LEADING, after whitespace). Text before a marker is content.
MARKERS = {"qwen3": ("<tool_call>",), "qwen3_coder": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "deepseek": (DS_BEGIN,), "llama3_json": (), "gemma": ()}
LEADING = {"qwen3": (), "qwen3_coder": (), "mistral": (), "deepseek": (), "llama3_json": ("{", "<|python_tag|>"), "gemma": ("[", "```")}


def has_call(fmt: str, text: str) -> int:
    """Where a call begins in `text`, or -1."""
    found = [i for i in (text.find(m) for m in MARKERS[fmt]) if i >= 0]
    stripped = text.lstrip()
    if any(stripped.startswith(m) for m in LEADING[fmt]):
        found.append(len(text) - len(stripped))
    return min(found) if found else -1


def parse(fmt: str, text: str, tools: list[dict]) -> tuple[str, list[Call]] | None:
    """(content before the calls, calls) when `text` holds well-formed calls
    in `fmt`; None when it holds none or a malformed one (it is text)."""
    if has_call(fmt, text) < 0:
        return None
    params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    try:
        found = _PARSERS[fmt](text, params)
    except (ValueError, TypeError, RecursionError, MemoryError):
        return None
    if found is None or not found[1]:
        return None
    return found


# Where a forced reply's calls may be cut back to when max_tokens ends it
# inside one: (the text that ends a call or parts two, whether it belongs
# to the call before it, what closes the list of calls).
_CUT = {
    "qwen3": ("</tool_call>", True, ""),
    "qwen3_coder": ("</tool_call>", True, ""),
    "deepseek": (DS_CALL_END, True, DS_END),
    "mistral": (",", False, "]"),
    "llama3_json": ("; ", False, ""),
    "gemma": (", ", False, "]"),
}
# Places tried, from the end; a forced reply holds at most MAX_CALLS calls,
# but a separator may also occur inside their arguments.
MAX_CUTS = 256


def complete_calls(fmt: str, text: str, tools: list[dict]) -> tuple[str, list[Call]] | None:
    """The calls of a forced reply cut short inside one (max_tokens): the
    whole calls before the cut one, or None when there are none."""
    end, inclusive, closer = _CUT[fmt]
    at = len(text)
    for _ in range(MAX_CUTS):
        at = text.rfind(end, 0, at)
        if at < 0:
            return None
        found = parse(fmt, text[: at + len(end) if inclusive else at] + closer, tools)
        if found is not None:
            return found
    return None


# -- grammars for forced calls ---------------------------------------------------------


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: dict) -> str:
    # Compact, as response_format's JSON: a looping model cannot pad a call
    # with whitespace until max_tokens.
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def _object(schema: dict) -> dict:
    """A tool's parameters as the schema of its arguments: an object, and
    (unless the schema says otherwise) with no properties it does not name,
    as OpenAI's strict function calling holds them."""
    return {"type": "object", "additionalProperties": False, **schema}


def _named(tools: list[dict], args_key: str) -> dict:
    """One JSON object per tool: {"name": NAME, args_key: its parameters}."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, args_key: _object(t["function"].get("parameters") or {"type": "object"})},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _coder_rules(tools: list[dict]) -> list[str]:
    rules = []
    alternatives = []
    for n, tool in enumerate(tools):
        fn = tool["function"]
        schema = fn.get("parameters") or {}
        required = set(schema.get("required") or [])
        parts = []
        for m, (pname, pschema) in enumerate((schema.get("properties") or {}).items()):
            pschema = pschema if isinstance(pschema, dict) else {}
            if pschema.get("type") == "string" and isinstance(pschema.get("enum"), list):
                value = "(" + " | ".join(_lark_str(str(v)) for v in pschema["enum"]) + ")"
            elif pschema.get("type") == "string":
                # Text up to the line's end (the parser reads it raw), within the schema's lengths.
                low, high = pschema.get("minLength", 1), pschema.get("maxLength")
                value = f"/[^<\\n]{{{max(1, int(low))},{int(high) if high is not None else ''}}}/"
            else:
                rules.append(f"v{n}_{m}: {_json_rule(pschema)}")
                value = f"v{n}_{m}"
            part = f"{_lark_str(f'<parameter={pname}>' + chr(10))} {value} {_lark_str(chr(10) + '</parameter>' + chr(10))}"
            parts.append(part if pname in required else f"({part})?")
        head = _lark_str(f"<tool_call>\n<function={fn['name']}>\n")
        rules.append(f"c{n}: {head} {' '.join(parts)} {_lark_str('</function>' + chr(10) + '</tool_call>')}")
        alternatives.append(f"c{n}")
    rules.append("call: " + " | ".join(alternatives))
    return rules


def grammar(fmt: str, tools: list[dict], parallel: bool) -> str:
    """A Lark grammar whose every sentence is one call (or, with `parallel`,
    one or more) to one of `tools`, in `fmt`."""
    if fmt == "qwen3":
        rules = [f'call: "<tool_call>\\n" {_json_rule(_named(tools, "arguments"))} "\\n</tool_call>"']
        sep = '"\\n"'
    elif fmt == "qwen3_coder":
        rules = _coder_rules(tools)
        sep = '"\\n"'
    elif fmt == "llama3_json":
        rules = [f"call: {_json_rule(_named(tools, 'parameters'))}"]
        sep = '"; "'
    elif fmt == "mistral":
        rules = [f"call: {_json_rule(_named(tools, 'arguments'))}"]
        body = f'call ("," call){{0,{MAX_CALLS - 1}}}' if parallel else "call"
        return "\n".join([f'start: "[TOOL_CALLS][" {body} "]"', *rules])
    elif fmt == "gemma":
        # Keyword arguments with JSON values (Python literals but for
        # true/false/null, which the parser reads too); the required ones,
        # in order: a forced call needs nothing more to be valid.
        rules, alternatives = [], []
        for n, tool in enumerate(tools):
            fn = tool["function"]
            schema = fn.get("parameters") or {}
            props = schema.get("properties") or {}
            words = []
            for m, pname in enumerate(p for p in schema.get("required") or [] if p in props):
                pschema = props[pname] if isinstance(props[pname], dict) else {}
                rules.append(f"a{n}_{m}: {_json_rule(pschema)}")
                words.append(('", " ' if m else "") + f"{_lark_str(pname + '=')} a{n}_{m}")
            rules.append(f'c{n}: {_lark_str(fn["name"] + "(")} {" ".join(words)} ")"')
            alternatives.append(f"c{n}")
        rules.append("call: " + " | ".join(alternatives))
        body = f'call (", " call){{0,{MAX_CALLS - 1}}}' if parallel else "call"
        return "\n".join([f'start: "[" {body} "]"', *rules])
    elif fmt == "deepseek":
        rules = []
        alternatives = []
        for n, tool in enumerate(tools):
            fn = tool["function"]
            head = _lark_str(f"{DS_CALL}function{DS_SEP}{fn['name']}\n```json\n")
            rules.append(f"a{n}: {_json_rule(_object(fn.get('parameters') or {'type': 'object'}))}")
            rules.append(f"c{n}: {head} a{n} {_lark_str(chr(10) + '```' + DS_CALL_END)}")
            alternatives.append(f"c{n}")
        rules.append("call: " + " | ".join(alternatives))
        body = f"call{{1,{MAX_CALLS}}}" if parallel else "call"
        return "\n".join([f"start: {_lark_str(DS_BEGIN)} {body} {_lark_str(DS_END)}", *rules])
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    body = f"call ({sep} call){{0,{MAX_CALLS - 1}}}" if parallel else "call"
    return "\n".join([f"start: {body}", *rules])
