"""`lattice-pool`: serve, run, chat, ps, demo-model."""

from __future__ import annotations

import argparse
import subprocess
import sys

from supervisor.workerexec import worker_argv, worker_env


def cmd_demo_model(args: argparse.Namespace, extra: list[str]) -> int:
    # Building weights needs MLX, which only worker-side code imports.
    return subprocess.call(worker_argv("worker.demo_model", *extra), env=worker_env())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lattice-pool", description="A pool of warm MLX model workers behind one stdin endpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo-model", help="write a tiny real-architecture Qwen3.5 demo model", add_help=False)
    demo.set_defaults(func=cmd_demo_model, passthrough=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "passthrough", False) and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args, extra)
