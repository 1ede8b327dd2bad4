"""The service definitions in configs/ (docs/service.md) parse, and the
command they run is one `lattice-pool` accepts."""

import configparser
import plistlib
import shlex
import shutil
import subprocess
import sys

import pytest

from harness.procs import ROOT
from supervisor.cli import build_parser


def accepted(argv: list[str]) -> None:
    """argv (after the program) parses as lattice-pool's command line."""
    args, extra = build_parser().parse_known_args(argv)
    assert not extra and args.command == "serve" and args.no_stdin and args.http, argv


def test_the_launchd_plist():
    with open(ROOT / "configs" / "lattice-pool.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "dev.lattice.pool" and plist["RunAtLoad"] is True
    program, *argv = plist["ProgramArguments"]
    assert program.endswith("/.venv/bin/lattice-pool")
    accepted(argv)
    # Longer than the pool's default 30 s grace, so launchd never kills a stop midway.
    assert plist["ExitTimeOut"] > 30 and plist["KeepAlive"] == {"SuccessfulExit": False}


def test_the_systemd_unit(tmp_path):
    unit = ROOT / "configs" / "lattice-pool.service"
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(unit)
    assert parser.sections() == ["Unit", "Service", "Install"]
    program, *argv = shlex.split(parser["Service"]["ExecStart"])
    assert program.endswith("/.venv/bin/lattice-pool")
    accepted(argv)
    assert int(parser["Service"]["TimeoutStopSec"]) > 30 and parser["Install"]["WantedBy"] == "default.target"
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze here: configparser's check only")
    # verify wants the program to exist: the same unit with an executable that does.
    copy = tmp_path / "lattice-pool.service"
    copy.write_text(unit.read_text().replace(program, sys.executable))
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ignoring" not in out.stderr and "Unknown" not in out.stderr, out.stderr
