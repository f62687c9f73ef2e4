"""``twin dashboard [--port N] [--address A] [--print-command]``: the what-if dashboard (docs/dashboard.md).

Runs ``streamlit run dashboard/app.py`` on a loopback address, headless (no browser is opened; open the URL
it prints), with Streamlit's usage statistics off. Needs the ``dashboard`` extra and a source checkout
(the app lives in ``dashboard/`` beside ``twin/``). Exit codes: Streamlit's; 2 when Streamlit or the app
is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

from twin.paths import REPO_ROOT

APP = REPO_ROOT / "dashboard" / "app.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8501, help="TCP port to serve on (default 8501)")
    p.add_argument("--address", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--print-command", action="store_true", help="print the streamlit command line and exit")


def command(*, address: str, port: int) -> list[str]:
    """The streamlit command line that serves the dashboard."""
    return [sys.executable, "-m", "streamlit", "run", str(APP), "--server.address", address, "--server.port",
            str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false"]


def run(args: argparse.Namespace) -> int:
    cmd = command(address=args.address, port=args.port)
    if args.print_command:
        print(" ".join(cmd))
        return 0
    if importlib.util.find_spec("streamlit") is None:
        print("twin dashboard: streamlit is not installed; install the dashboard extra: pip install -e '.[dashboard]'",
              file=sys.stderr)
        return 2
    if not APP.exists():
        print(f"twin dashboard: {APP} not found; the dashboard runs from a source checkout", file=sys.stderr)
        return 2
    print(f"twin dashboard: serving on http://{args.address}:{args.port}/ (Ctrl-C stops it)", file=sys.stderr)
    try:
        return subprocess.call(cmd, cwd=REPO_ROOT)
    except KeyboardInterrupt:
        return 0
