"""The sampling fields' bounds (ipc.sampling) hold alike on every surface: a
stdin line, an HTTP body, a CLI flag, the chat's /set and the pool's
[defaults] table, so no default can put into a request a value the request
could not carry itself. In-process, no worker: each surface's own reading."""

from __future__ import annotations

import contextlib
import io

import msgspec
import pytest

from ipc import sampling
from supervisor.chat import Chat
from supervisor.cli import build_parser
from supervisor.config import ConfigError, load_config
from supervisor.httpapi.shapes import HttpError, chat_request
from supervisor.requests import BadRequest, parse_line
from supervisor.screen import Screen

# (field, a value just outside its bounds, what the refusal says, the bound itself)
EDGES = [
    ("temperature", 100.5, "<= 100.0", 100.0),
    ("top_k", -1, ">= 0", 0),
    ("top_p", 1.5, "<= 1.0", 1.0),
    ("repetition_penalty", 0.0, "> 0.0", 100.0),
    ("max_tokens", 10_000_001, "<= 10000000", 10_000_000),
    ("seed", -1, ">= 0", 2**63 - 1),
    ("reasoning_budget", -1, ">= 0", 0),
]
SURFACES = ("stdin", "http", "cli", "chat", "config")


def refusal(surface: str, name: str, value: object, tmp_path) -> str | None:
    """What `surface` says when given `name` = `value`; None when it takes it."""
    if surface == "stdin":
        try:
            parse_line(msgspec.json.encode({"prompt": "x", name: value}))
        except BadRequest as exc:
            return exc.msg
    elif surface == "http":
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], name: value}
        try:
            msg, _ = chat_request(body, "chatcmpl-1", lambda model: "m")
        except HttpError as exc:
            assert exc.status == 400 and exc.param == name
            return exc.message
        assert getattr(msg, name) == value
    elif surface == "cli":
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
            args = build_parser().parse_args(["run", "--prompt", "x", "--" + name.replace("_", "-"), str(value)])
            assert getattr(args, name) == value
        return err.getvalue() or None
    elif surface == "chat":
        notes = io.StringIO()
        Chat(build_parser().parse_args(["chat"]), Screen(io.StringIO(), notes)).set(f"{name} {value}")
        return None if "set to" in notes.getvalue() else notes.getvalue()
    else:
        (tmp_path / "c.toml").write_text(f"[defaults]\n{name} = {value}\n")
        try:
            assert getattr(load_config(tmp_path / "c.toml").defaults, name) == value
        except ConfigError as exc:
            return str(exc)
    return None


@pytest.mark.parametrize("surface", SURFACES)
def test_every_surface_holds_a_sampling_field_to_the_same_bounds(surface, tmp_path):
    assert {name for name, *_ in EDGES} == set(sampling.NAMES), "every field is tried"
    for name, outside, says, bound in EDGES:
        why = refusal(surface, name, outside, tmp_path)
        assert why is not None and name in why and says in why, (name, why)
        assert refusal(surface, name, bound, tmp_path) is None, name


def test_a_default_no_request_may_carry_is_refused_at_load(tmp_path):
    # A pool default ends up in requests, so it is bounded as theirs are.
    path = tmp_path / "c.toml"
    path.write_text("[defaults]\ntemperature = 150.0\n")
    with pytest.raises(ConfigError, match=r"c\.toml: key `defaults\.temperature`: Expected `float` <= 100\.0"):
        load_config(path)
