"""An engine pool's keeper of one warm process: ``python -m skyrl_cli.engines.keeper --dir DIR --pool POOL -- COMMAND...``.

It keeps one generation of a warm process (``backends.standby``: the learner's ranks under
torchrun, or the orchestrator) ready for the next run: it starts generation N in ``DIR/gen-<N>``
(a torchrun command gets a rendezvous port free at that moment), waits for it to exit, records
its exit code for the run that used it, and once that run has let go of the pool starts
generation N+1. Waiting for the run keeps the next generation's imports off the cores while the
run still works (its final evaluation follows the learner's exit).

It stops, leaving no generation behind, on SIGTERM (``skyrl engines down``) and after a
generation that ended without a job: that is a standby that could not start (its log says why),
and starting it again would only fail again. A run then starts its own process as without a pool.
Light: no torch here, so the keeper itself costs a few tens of MiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from skyrl_cli.engines.pool import live_holder
from skyrl_cli.plan.trainer import RDZV_FLAG
from skyrl_contracts.atomic import write_json
from skyrl_contracts.ports import find_free_ports
from skyrl_contracts.standby import AGENT_LOG, CURRENT_FILE, EXIT_FILE, Job, gen_dir

HOLDER_POLL_S = 0.5


def with_fresh_port(argv: list[str]) -> list[str]:
    """A torchrun command with its rendezvous on a port free now (a generation's port is its own)."""
    out = list(argv)
    if RDZV_FLAG not in out:
        return out
    i = out.index(RDZV_FLAG) + 1
    host = out[i].rsplit(":", 1)[0]
    out[i] = f"{host}:{find_free_ports(1, host if host not in ('', 'localhost') else '127.0.0.1')[0]}"
    return out


def copy_agent_log(gen: Path, job: Job) -> None:
    """The generation's own lines (torchrun's summary of a failed rank) into the run's log."""
    try:
        text = (gen / AGENT_LOG).read_text(errors="replace")
        with open(job.log, "a") as fh:
            fh.write(text)
    except OSError:
        pass


class Keeper:
    def __init__(self, directory: Path, pool: Path, command: list[str]):
        self.dir = directory
        self.pool = pool
        self.command = command
        self.agent: subprocess.Popen | None = None
        self.stopping = False

    def stop(self, *_args) -> None:
        self.stopping = True
        if self.agent is not None and self.agent.poll() is None:
            try:
                os.killpg(self.agent.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def run_generation(self, gen: int) -> Job | None:
        """Start generation ``gen``, wait for its end; the job it ran, if it ran one."""
        folder = gen_dir(self.dir, gen)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / AGENT_LOG, "ab", buffering=0) as log:
            self.agent = subprocess.Popen(
                [*with_fresh_port(self.command), "--gen-dir", str(folder)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # the run that takes the job tears down its group, not the keeper
            )
        write_json(self.dir / CURRENT_FILE, {"gen": gen, "agent_pid": self.agent.pid, "since": time.time()})
        print(f"generation {gen}: pid {self.agent.pid}", flush=True)
        code = self.agent.wait()
        write_json(folder / EXIT_FILE, {"code": code})
        job = Job.read(folder)
        print(f"generation {gen}: exit code {code}" + (f" (run {job.run_dir})" if job else ""), flush=True)
        if job is not None and code != 0:
            copy_agent_log(folder, job)
        return job

    def loop(self) -> int:
        gen = 0
        while not self.stopping:
            job = self.run_generation(gen)
            if job is None:
                if not self.stopping:
                    print(f"generation {gen} ended without a run; see {gen_dir(self.dir, gen) / AGENT_LOG}")
                break
            # The holder record, not the lock: trying the lock every half second would make a run
            # that starts in that instant find the pool busy.
            while live_holder(self.pool) is not None and not self.stopping:
                time.sleep(HOLDER_POLL_S)
            if gen > 0:  # the one before last: its run has read its exit code long ago
                shutil.rmtree(gen_dir(self.dir, gen - 1), ignore_errors=True)
            gen += 1
        (self.dir / CURRENT_FILE).unlink(missing_ok=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skyrl_cli.engines.keeper")
    parser.add_argument("--dir", required=True, type=Path, help="the pool's folder for this warm process")
    parser.add_argument("--pool", required=True, type=Path, help="the pool's folder (whose holder.json names its run)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the standby's command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    keeper = Keeper(args.dir, args.pool, command)
    signal.signal(signal.SIGTERM, keeper.stop)
    signal.signal(signal.SIGINT, keeper.stop)
    return keeper.loop()


if __name__ == "__main__":
    sys.exit(main())
