"""Tinker server: aggregate training (and sampling) throughput of 1 vs 4 concurrent SDK clients.

Each client is an official `tinker` SDK TrainingClient on its own LoRA adapter, doing
forward_backward (cross_entropy) + optim_step steps on the same base model. Subject: the server as
it runs (pending forward_backward requests of different adapters batched into one pass). Baseline,
side by side in the same run: the same server with `batch_adapters = False` (one pass per
adapter). Prints aggregate steps/s for 1 and 4 clients in both modes and the 4-vs-1 ratios (median
over the repetitions); with --sampling also samples/s of 1 vs 4 sampling clients on one vLLM engine.

    python benchmarks/bench_tinker.py [--reps 3] [--steps 12] [--sampling]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
KEYS = [f"tml-bench{i}" for i in range(4)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(out: Path, hidden: int, layers: int) -> Path:
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tok = build_char_tokenizer(string.digits + string.ascii_lowercase + " +-*=?.,")
    model = build_tiny_model(
        TinyModelInit(hidden_size=hidden, layers=layers, heads=4, max_position_embeddings=512), tok, 0
    )
    return save_hf(model, tok, out)


class Server:
    def __init__(self, model_dir: Path, storage: Path, batch: bool, sample_url: str | None = None, engines=()):
        self.port = free_port()
        config = {
            "base_model": "bench",
            "model_dir": str(model_dir),
            "storage_dir": str(storage),
            "api_keys": KEYS,
            "host": "127.0.0.1",
            "port": self.port,
            "max_live_adapters": 16,
            "batch_adapters": batch,
            "max_sequence_tokens": 512,
            "sample_url": sample_url,
            "engine_urls": list(engines),
        }
        self.config_path = storage.parent / f"server-{self.port}.json"
        self.config_path.write_text(json.dumps(config))
        self.log = open(storage.parent / f"server-{self.port}.log", "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("BENCH_TRAINER_THREADS", "1")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "backends.tinker.server", "--config", str(self.config_path)],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log.name}")
            time.sleep(0.3)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def datums(types, seq_len: int, count: int, offset: int):
    out = []
    for j in range(count):
        seq = [7 + (offset + j + i) % 36 for i in range(seq_len + 1)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * seq_len},
            )
        )
    return out


def timed_clients(clients: int, work) -> float:
    """Seconds the timed part of ``work(index, ready)`` takes over ``clients`` concurrent threads:
    each thread sets up and warms up, calls ``ready()``, then does the timed work; the clock runs
    from the moment every thread is ready to the moment the last one is done."""
    barrier = threading.Barrier(clients + 1)
    done = threading.Barrier(clients + 1)
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            work(index, barrier.wait)
            done.wait()
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            errors.append(err)
            barrier.abort()
            done.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    done.wait()
    elapsed = time.perf_counter() - started
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return elapsed


def train_client(index: int, url: str, steps: int, seq_len: int, per_step: int, ready) -> None:
    """One SDK client: a LoRA of its own, one warm-up step, ``ready()``, then ``steps`` timed steps
    (forward_backward + optim_step each). Used by the thread and the process variants alike."""
    import tinker
    from tinker import types

    with tinker.ServiceClient(base_url=url, api_key=KEYS[index]) as sc:
        tc = sc.create_lora_training_client(base_model="bench", rank=8).result()
        data = datums(types, seq_len, per_step, index * 5)

        def step():
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            fb.result()
            opt.result()

        step()
        ready()
        for _ in range(steps):
            step()


def run_training(url: str, clients: int, steps: int, seq_len: int, per_step: int) -> float:
    """Aggregate optimizer steps/s of ``clients`` concurrent SDK clients (after one warm-up step)."""

    def work(index: int, ready) -> None:
        train_client(index, url, steps, seq_len, per_step, ready)

    return clients * steps / timed_clients(clients, work)


def _process_client(index, url, steps, seq_len, per_step, barrier, done, out):
    train_client(index, url, steps, seq_len, per_step, barrier.wait)
    done.wait()
    out.put(index)


def run_training_processes(url: str, clients: int, steps: int, seq_len: int, per_step: int) -> float:
    """As ``run_training``, each client in its own process (no shared GIL on the client side)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, done, out = ctx.Barrier(clients + 1), ctx.Barrier(clients + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_process_client, args=(i, url, steps, seq_len, per_step, barrier, done, out))
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    barrier.wait(timeout=600)
    started = time.perf_counter()
    done.wait(timeout=600)
    elapsed = time.perf_counter() - started
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode for p in procs):
        raise RuntimeError("a client process failed")
    return clients * steps / elapsed


def run_sampling(url: str, clients: int, requests: int, max_tokens: int) -> float:
    """Aggregate sample requests/s of ``clients`` concurrent SDK clients (after one warm-up request)."""
    import tinker
    from tinker import types

    def work(index: int, ready) -> None:
        with tinker.ServiceClient(base_url=url, api_key=KEYS[index]) as sc:
            tc = sc.create_lora_training_client(base_model="bench", rank=8).result()
            sampler = tc.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints([7 + (index + i) % 36 for i in range(16)])
            params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
            sampler.sample(prompt, 1, params).result()
            ready()
            futures = [sampler.sample(prompt, 1, params) for _ in range(requests)]
            for f in futures:
                f.result()

    return clients * requests / timed_clients(clients, work)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--datums", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--client-processes", action="store_true", help="each training client in its own process")
    parser.add_argument("--sampling", action="store_true", help="also sampling on one vLLM engine (CPU: ~30 s start)")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = Path(tempfile.mkdtemp(prefix="bench-tinker-"))
    model_dir = build_model(tmp / "model", args.hidden, args.layers)
    print(
        f"model hidden {args.hidden} x {args.layers} layers; step = forward_backward over {args.datums} x "
        f"{args.seq_len} tokens + optim_step; {args.steps} steps per client, {args.reps} reps",
        flush=True,
    )
    figures: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for batch in (True, False):
            mode = "batched" if batch else "one pass per adapter"
            server = Server(model_dir, tmp / f"st-{rep}-{batch}", batch)
            try:
                for clients in (1, 4):
                    runner = run_training_processes if args.client_processes else run_training
                    rate = runner(server.url, clients, args.steps, args.seq_len, args.datums)
                    figures.setdefault(f"{mode}|{clients}", []).append(rate)
                    print(f"rep {rep} {mode:>21}: {clients} client(s) {rate:6.2f} steps/s", flush=True)
            finally:
                server.stop()
    print("\ntraining, aggregate optimizer steps/s (median):")
    for mode in ("batched", "one pass per adapter"):
        one, four = statistics.median(figures[f"{mode}|1"]), statistics.median(figures[f"{mode}|4"])
        ratios = [f4 / f1 for f1, f4 in zip(figures[f"{mode}|1"], figures[f"{mode}|4"])]
        print(
            f"  {mode:>21}: 1 client {one:.2f}, 4 clients {four:.2f}: 4 vs 1 = {statistics.median(ratios):.2f}x "
            f"(per rep {', '.join(f'{r:.2f}' for r in ratios)})"
        )
    if args.sampling:
        sampling(args, model_dir, tmp)


def sampling(args, model_dir: Path, tmp: Path) -> None:
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import Machine, engine_specs, engine_url
    from skyrl_cli.plan.tinker import with_max_loras
    from skyrl_cli.recipe.lengths import with_model_lengths
    from skyrl_contracts.schema import Recipe

    recipe = with_model_lengths(
        Recipe.model_validate(
            {
                "name": "b",
                "model": {"path": str(model_dir), "lora": {"rank": 8}},
                "tinker": {},
                "inference": {"engines": 1},
            }
        )
    )
    machine = Machine("cpu", engine_cores=tuple(sorted(os.sched_getaffinity(0))))
    port = free_port()
    (spec,) = [with_max_loras(s, 8) for s in engine_specs(recipe, machine, [port], str(model_dir))]
    with Supervisor(tmp / "engine-run") as sup:
        sup.start(spec)
        sup.wait_ready([spec.name])
        url = engine_url(machine, port)
        server = Server(model_dir, tmp / "st-sampling", True, sample_url=url, engines=[url])
        try:
            rates: dict[int, list[float]] = {1: [], 4: []}
            for rep in range(args.reps):
                for clients in (1, 4):
                    rates[clients].append(run_sampling(server.url, clients, 16, 32))
                    print(f"rep {rep} sampling: {clients} client(s) {rates[clients][-1]:6.2f} requests/s", flush=True)
        finally:
            server.stop()
    ratios = [b / a for a, b in zip(rates[1], rates[4])]
    print(
        f"\nsampling (32 tokens per request, each client its own adapter), requests/s (median): 1 client "
        f"{statistics.median(rates[1]):.2f}, 4 clients {statistics.median(rates[4]):.2f}: 4 vs 1 = "
        f"{statistics.median(ratios):.2f}x"
    )


if __name__ == "__main__":
    main()
