"""The `verst dashboard` and `verst report` subcommands (added to the `verst` parser by `cli.py`)."""

from __future__ import annotations

import argparse
from typing import Any

from verst.rollout.errors import ConfigError, Problem


def add_subcommands(sub: Any) -> None:
    """Add `dashboard` and `report` to the `verst` subparsers; each sets `func`."""
    dash = _runs_parser(
        sub,
        "dashboard",
        help="a live web view of runs: curves, rollout timeline, samples",
        description="Serve a read-only web page for one or more run directories (live while they run).",
    )
    dash.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    dash.add_argument("--port", type=int, default=8391, help="port (default 8391; 0 picks a free one)")
    dash.add_argument(
        "--token",
        default=None,
        help="access token every request must carry (default: none on loopback; a random one, "
        "printed with the URL, for any other --host)",
    )
    dash.set_defaults(func=cmd_dashboard)
    rep = _runs_parser(
        sub,
        "report",
        help="write the dashboard's views of runs as one self-contained HTML file",
        description="Write an HTML file with the overview, curves, timeline and samples; it opens offline.",
    )
    rep.add_argument(
        "-o", "--output", default="report.html", help="the HTML file to write (default report.html)"
    )
    rep.set_defaults(func=cmd_report)


def _runs_parser(sub: Any, name: str, *, help: str, description: str) -> Any:
    """A subcommand that takes one or more run directories (`RUN_DIR ...`)."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (run.output_dir)")
    return parser


def _check_dirs(paths: list[str]) -> None:
    from pathlib import Path

    problems = [
        Problem(
            p,
            "not a run directory (does not exist)",
            "pass the run.output_dir of a run, e.g. runs/reverse_digits",
        )
        for p in paths
        if not Path(p).is_dir()
    ]
    if problems:
        raise ConfigError(problems)


def cmd_dashboard(args: argparse.Namespace) -> int:
    """`verst dashboard RUN_DIR...`: serve until Ctrl-C."""
    _check_dirs(args.run_dirs)
    import sys

    from verst.trainer.dashboard.auth import is_loopback, new_token
    from verst.trainer.dashboard.server import serve

    token = args.token
    if not is_loopback(args.host):
        token = token or new_token()
        print(
            f"verst dashboard: --host {args.host} is reachable from other machines and the dashboard "
            "has no login; every request needs the access token in the URL below (or --token)",
            file=sys.stderr,
            flush=True,
        )
    serve(
        args.run_dirs,
        host=args.host,
        port=args.port,
        token=token,
        on_ready=lambda line: print(line, flush=True),
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """`verst report RUN_DIR... -o report.html`."""
    _check_dirs(args.run_dirs)
    from verst.trainer.dashboard.report import build_report

    path = build_report(args.run_dirs, args.output)
    print(f"verst report: wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)
    return 0
