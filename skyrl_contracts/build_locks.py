"""Who holds a lock of DeepSpeed's one-time op builds.

DeepSpeed compiles its CPU ops into ``TORCH_EXTENSIONS_DIR`` under torch's ``FileBaton``: an empty
``<op>/lock`` file that exists while a build runs and that every other process waits on until it
disappears. An empty file cannot say whether its builder still lives, so a lock that a killed
build left behind, and the lock of a build another run is doing right now, look the same. skyrl's
trainer processes write their owner into the locks they take (``backends.train.engine``), and the
driver removes a lock whose owner on this host is gone, and leaves one whose owner lives until it
is older than any build takes (``skyrl_cli.launch.op_builds``). Standard library only: both sides read the same format.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def owner_text() -> str:
    """What a process writes into a lock it took: its host and pid."""
    return f"{socket.gethostname()} {os.getpid()}\n"


def write_owner(lock: str | Path) -> None:
    """Write this process's ``owner_text`` into ``lock`` (which it has just created)."""
    fd = os.open(lock, os.O_WRONLY)
    try:
        os.write(fd, owner_text().encode())
    finally:
        os.close(fd)


def owner_pid(lock: str | Path) -> int | None:
    """The pid that holds ``lock`` when it was taken on this host by a process that says so;
    None for an empty lock (a builder that is not skyrl's, or one killed before it wrote), another
    host's, or one that is gone."""
    try:
        text = Path(lock).read_text().split()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    if len(text) != 2 or text[0] != socket.gethostname() or not text[1].isdigit():
        return None
    return int(text[1])
