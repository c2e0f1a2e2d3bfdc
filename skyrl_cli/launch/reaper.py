"""A watchdog that outlives a SIGKILLed driver just long enough to tear its processes down.

The supervisor starts it with a pipe on stdin and writes ``+<pgid>`` when it starts a process group
and ``-<pgid>`` when it has stopped one. When the pipe closes without a final ``done`` line (the
driver died, however it died), the reaper SIGTERMs every group it still knows, waits a grace period
and SIGKILLs them. This reaches grandchildren (vLLM's EngineCore, torchrun's workers) that
``PR_SET_PDEATHSIG`` alone would leave behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time

GRACE_S = 5.0


def _kill_groups(groups: set[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def main() -> None:
    # Ignore the terminal's Ctrl-C: the driver handles it and tells us "done".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups: set[int] = set()
    for line in sys.stdin:
        line = line.strip()
        if line == "done":
            return
        if line[:1] == "+":
            groups.add(int(line[1:]))
        elif line[:1] == "-":
            groups.discard(int(line[1:]))
    if groups:
        _kill_groups(groups, signal.SIGTERM)
        time.sleep(GRACE_S)
        _kill_groups(groups, signal.SIGKILL)


if __name__ == "__main__":
    main()
