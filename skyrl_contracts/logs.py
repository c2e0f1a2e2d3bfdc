"""One logging path for every launched process: Python ``logging`` to stderr, which the supervisor
writes to ``logs/<process>.log`` with stdout, in one format everywhere. A process's machine-readable
answer (a child's JSON result line) stays on stdout as ``print``; everything said to a reader is a
log record."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LOGGERS = ("httpx",)  # one line per request otherwise


def setup_process_logging(level: int = logging.INFO) -> None:
    """Call first in a process's ``main``; later calls change nothing (``logging.basicConfig``)."""
    logging.basicConfig(level=level, format=FORMAT)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
