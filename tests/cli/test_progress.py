"""Progress of long commands: a bar on a terminal, nothing but the command's lines in a pipe.

`vramcast trace --matrix` reports through `Progress`; these run it in a child process, once
with pipes and once on a pseudo-terminal, as a user's shell would.
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

# Three steps, each printing its line, as `trace --matrix` does per case.
SCRIPT = """
from service.cli.progress import Progress
with Progress(3, "tracing", unit="case") as progress:
    for index in range(3):
        progress.now(f"case-{index}")
        progress.echo(f"[{index + 1}/3] done case-{index}")
        progress.step()
print("3 references")
"""
LINES = ["[1/3] done case-0", "[2/3] done case-1", "[3/3] done case-2", "3 references"]
TIMEOUT_S = 60


def test_piped_output_is_only_the_lines() -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "".join(f"{line}\n" for line in LINES)
    assert run.stderr == ""


def test_a_terminal_shows_the_bar() -> None:
    leader, follower = pty.openpty()
    # A terminal of 24 rows of 100 columns (a new pseudo-terminal has 0 of each).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        stdin=follower,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert child.wait(timeout=TIMEOUT_S) == 0
    screen = b"".join(chunks).decode()
    assert "tracing:" in screen and "2/3" in screen and "case-2" in screen  # bar, count, step
    assert "\r" in screen.replace("\r\n", "")  # redrawn in place
    for line in LINES:
        assert line in screen
