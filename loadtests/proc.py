"""The server as a process: start `streamworld serve`, sample its resources, read its log.

The chaos suite (`loadtests/chaos.py`) starts the server itself, as a subprocess, so that it
can watch what a client cannot see: the process's resident memory, threads and open file
descriptors (from `/proc/PID/status` and `/proc/PID/fd`, so Linux only), and the server's
log, which is scanned for tracebacks, `ERROR` lines and HTTP 5xx responses. It runs the
server through its console entry point and imports nothing of it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

# aiohttp's access log: `... "GET /metrics HTTP/1.1" 503 123 ...`
_ACCESS_5XX = re.compile(r'"[A-Z]+ [^"]*" 5\d\d ')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A `streamworld serve` subprocess whose stdout and stderr go to `log_path`."""

    popen: subprocess.Popen
    port: int
    log_path: Path
    log_file: TextIO

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def log_text(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")

    def terminate(self, grace_s: float) -> tuple[int | None, float]:
        """SIGTERM, then wait up to `grace_s`: (exit code or None if still running, seconds)."""
        t0 = time.monotonic()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            rc = self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            rc = None
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)
        self.log_file.close()


def serve_command(model: str, device: str, port: int, extra: list[str]) -> list[str]:
    # `python -m streamworld` is the console script's twin, and needs no PATH lookup.
    head = [sys.executable, "-m", "streamworld", "serve", "--model", model, "--device", device]
    return [*head, "--port", str(port), *extra]


def start_server(model: str, device: str, extra: list[str], log_path: Path) -> ServerProcess:
    port = free_port()
    log_file = log_path.open("w")
    popen = subprocess.Popen(
        serve_command(model, device, port, extra),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C of the suite must not reach the server first
    )
    return ServerProcess(popen, port, log_path, log_file)


async def wait_ready(server: ServerProcess, timeout_s: float) -> None:
    """Until `/healthz` answers 200; raises RuntimeError if the server exits or is too slow."""
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{server.port}/healthz"

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    while time.monotonic() < deadline:
        if server.popen.poll() is not None:
            raise RuntimeError(
                f"the server exited with {server.popen.returncode}:\n{server.log_text()[-3000:]}"
            )
        if await asyncio.to_thread(probe):
            return
        await asyncio.sleep(0.25)
    raise RuntimeError(f"the server did not answer /healthz within {timeout_s:.0f} s")


def sample_process(pid: int) -> dict[str, Any] | None:
    """{"rss_kb", "threads", "fds"} of a live process, or None (gone, or not Linux)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a process that has exited but not been reaped (a zombie)
        return None
    return {
        "rss_kb": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"].strip()),
        "fds": fds,
    }


def scan_log(text: str, keep: int = 20) -> dict[str, Any]:
    """Tracebacks, ` ERROR ` lines and HTTP 5xx access-log lines (counts, and the first few)."""
    lines = text.splitlines()
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    errors = [line for line in lines if " ERROR " in line]
    http_5xx = [line for line in lines if _ACCESS_5XX.search(line)]
    return {
        "tracebacks": len(tracebacks),
        "traceback_excerpts": ["\n".join(lines[max(0, i - 1) : i + 12]) for i in tracebacks[:keep]],
        "error_lines": len(errors),
        "error_excerpts": errors[:keep],
        "http_5xx": len(http_5xx),
        "http_5xx_excerpts": http_5xx[:keep],
    }
