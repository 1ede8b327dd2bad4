"""Tool calling on /v1/chat/completions: the request's `tools`,
`tool_choice` and `parallel_tool_calls` (and the legacy `functions` /
`function_call`), the chat template that renders them, and the reply read
back into `tool_calls` (supervisor.httpapi.tool_parsers holds the formats).

- The model's own chat template renders the tools and the history's calls
  and results. A template that knows no tools (no `tools` in its text, or
  none at all) gets them the way Qwen's templates write them: a system turn
  listing them, calls as `<tool_call>` JSON, results in `<tool_response>`.
- `auto`: the model chooses; a reply holding well-formed calls in its
  family's format becomes `tool_calls`, anything else is text.
- `required` or a named function: the reply is held to a Lark grammar of
  one call (or several, with `parallel_tool_calls`) to the allowed tools,
  through the same llguidance path as `response_format`, so it parses.
- `none`: the tools are not rendered and the reply is text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from supervisor.httpapi import tool_parsers
from supervisor.httpapi.tool_parsers import Call

# OpenAI's rule for a function name; it also keeps a name safe inside a grammar.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
# Chat templates read per model directory, least recently used out.
TEMPLATE_CACHE = 64
# A tokenizer_config.json larger than this is not read for its template.
MAX_TEMPLATE_FILE = 16 * 1024 * 1024

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class _Function(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(msgspec.Struct):
    function: _Function
    type: str = "function"


@dataclass
class ToolRequest:
    tools: list[dict]  # OpenAI's shape, as the template gets them
    choice: str  # "auto", "required", or the one function's name
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def allowed(self) -> list[dict]:
        if self.choice in ("auto", "required"):
            return self.tools
        return [t for t in self.tools if t["function"]["name"] == self.choice]


class ToolError(ValueError):
    """A request's tools or tool fields that cannot be used (a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


_bad = ToolError


def read_tools(data: dict) -> ToolRequest | None:
    """The request's tools and how to use them; None when it has none to
    use (no tools, or tool_choice "none")."""
    tools = data.get("tools")
    choice = data.get("tool_choice")
    param = "tools"
    if tools is None and data.get("functions") is not None:
        # The legacy form, before tools: the same functions.
        tools = [{"type": "function", "function": f} for f in data["functions"]] if isinstance(data["functions"], list) else data["functions"]
        param = "functions"
        legacy = data.get("function_call")
        choice = {"type": "function", "function": legacy} if isinstance(legacy, dict) else legacy
    if tools is None:
        if choice not in (None, "none"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad(f"{param} must be a list of at most {MAX_TOOLS} tools", param)
    try:
        specs = msgspec.convert(tools, list[_Tool])
    except msgspec.ValidationError as exc:
        raise _bad(f"invalid {param}: {exc}", param) from None
    rendered = []
    for spec in specs:
        if spec.type != "function":
            raise _bad(f"tools of type {spec.type!r} are not supported: function only", param)
        if not _NAME.fullmatch(spec.function.name):
            raise _bad(f"tool name {spec.function.name[:80]!r} must be 1-64 letters, digits, '_', '.' or '-'", param)
        if spec.function.parameters is not None and not isinstance(spec.function.parameters.get("properties", {}), dict):
            raise _bad(f"tool {spec.function.name!r}: parameters.properties must be an object", param)
        function = {"name": spec.function.name}
        if spec.function.description is not None:
            function["description"] = spec.function.description
        function["parameters"] = spec.function.parameters if spec.function.parameters is not None else {"type": "object", "properties": {}}
        rendered.append({"type": "function", "function": function})
    names = [t["function"]["name"] for t in rendered]
    if len(set(names)) != len(names):
        raise _bad("tool names must be unique", param)
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else choice.get("name")
        if name not in names:
            raise _bad(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise _bad('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}', "tool_choice")
    if choice == "none" or not rendered:
        if choice == "required":
            raise _bad('tool_choice "required" needs at least one tool', "tool_choice")
        return None
    parallel = data.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    return ToolRequest(rendered, choice, parallel)


# -- messages -----------------------------------------------------------------------


def _arguments(value: object) -> object:
    """A call's arguments as templates want them: an object (OpenAI sends
    a JSON string; Qwen3.5's template iterates it as a mapping)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):  # a string may nest deeper than any body
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def history_calls(calls: object) -> list[dict]:
    """An assistant message's `tool_calls` for the template."""
    if not isinstance(calls, list):
        raise _bad("tool_calls must be a list", "messages")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad("each tool_calls entry needs function.name", "messages")
        out.append(
            {"id": call.get("id") or "", "type": "function", "function": {"name": function["name"], "arguments": _arguments(function.get("arguments") or {})}}
        )
    return out


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that knows no tools: the tools in a system
    turn, calls and results as text, the way Qwen's templates write them."""
    out = []
    if tools:
        listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"] + "\n\n" + system
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
        elif m.get("tool_calls"):
            calls = "\n".join(
                '<tool_call>\n{"name": %s, "arguments": %s}\n</tool_call>'
                % (
                    json.dumps(c["function"]["name"]),
                    c["function"]["arguments"] if isinstance(c["function"]["arguments"], str) else json.dumps(c["function"]["arguments"], ensure_ascii=False),
                )
                for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


# -- the model's template --------------------------------------------------------------


@dataclass(frozen=True)
class TemplateInfo:
    format: str  # the tool-call format (tool_parsers.FORMATS)
    renders_tools: bool  # the template uses `tools`


_templates: OrderedDict[Path, TemplateInfo] = OrderedDict()


def _template_text(directory: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    try:
        if jinja.is_file() and jinja.stat().st_size <= MAX_TEMPLATE_FILE:
            return jinja.read_text("utf-8")
        config = directory / "tokenizer_config.json"
        if not config.is_file() or config.stat().st_size > MAX_TEMPLATE_FILE:
            return None
        template = json.loads(config.read_text("utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def template_info(directory: Path, override: str | None) -> TemplateInfo:
    """What the chat template in `directory` does with tools (read once per
    directory); `override` is the model's configured `tool_parser`."""
    info = _templates.get(directory)
    if info is None:
        text = _template_text(directory)
        info = TemplateInfo(tool_parsers.detect(text), text is not None and "tools" in text)
        _templates[directory] = info
        while len(_templates) > TEMPLATE_CACHE:
            _templates.popitem(last=False)
    else:
        _templates.move_to_end(directory)
    if override is not None and override != info.format:
        return TemplateInfo(override, info.renders_tools)
    return info


def forced_format(tools: ToolRequest, fmt: str) -> str:
    """The response_format (JSON text) that holds a forced reply to a call."""
    # A named function is one call to it, as OpenAI makes it.
    parallel = tools.parallel and tools.choice == "required"
    return json.dumps({"type": "grammar", "grammar": tool_parsers.grammar(fmt, tools.allowed(), parallel)})


# -- the reply ---------------------------------------------------------------------------


def _partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper start of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class ToolReader:
    """The answer's text as it streams: what may go out as content now,
    and the calls at the end. Text from where a call may begin is held back
    until the reply ends, then parsed; if it does not parse it goes out as
    content after all."""

    def __init__(self, tools: ToolRequest, fmt: str):
        self.tools = tools
        self.fmt = fmt
        self._markers = tool_parsers.MARKERS[fmt]
        self._leading = tool_parsers.LEADING[fmt]
        self._held = ""
        self._calling = False
        self._begun = False  # content other than whitespace went out: leading markers no longer apply

    def feed(self, text: str) -> str:
        if self._calling:
            self._held += text
            return ""
        buf = self._held + text
        at = [i for i in (buf.find(m) for m in self._markers) if i >= 0]
        stripped = buf.lstrip()
        if not self._begun and any(stripped.startswith(m) for m in self._leading):
            at.append(0)  # the whitespace before it is no content either
        if at:
            start = min(at)
            self._calling = True
            self._held = buf[start:]
            return self._out(buf[:start])
        if not self._begun and self._leading and (not stripped or any(m.startswith(stripped) for m in self._leading)):
            self._held = buf
            return ""
        keep = _partial_tail(buf, self._markers)
        self._held = buf[len(buf) - keep :] if keep else ""
        return self._out(buf[: len(buf) - keep])

    def _out(self, text: str) -> str:
        if text.strip():
            self._begun = True
        return text

    def finish(self, cut: bool = False) -> tuple[str, list[Call]]:
        """(text still to go out as content, the calls). `cut`: max_tokens
        ended the reply; a forced one then keeps its whole calls (its
        grammar wrote nothing else) and drops the one it was inside."""
        held, self._held = self._held, ""
        if not self._calling:
            return held, []
        if cut and self.tools.forced:
            found = tool_parsers.complete_calls(self.fmt, held, self.tools.tools)
        else:
            found = tool_parsers.parse(self.fmt, held, self.tools.tools)
        if found is None:
            return held, []
        content, calls = found
        if not self.tools.parallel:
            calls = calls[:1]
        return content, calls


def call_objects(calls: list[Call], with_index: bool = False) -> list[dict]:
    out = []
    for i, call in enumerate(calls):
        obj = {"id": "call_" + secrets.token_hex(12), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        out.append({"index": i, **obj} if with_index else obj)
    return out
