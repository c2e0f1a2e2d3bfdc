"""Disk weight sync vs delta weight sync, side by side in real RL runs on one machine.

Runs the RL stage of ``--recipe`` twice from the same start and seed, with
``inference.weight_sync = "disk"`` and then ``"delta"`` (every version after the first a delta:
``inference.full_version_every`` past the run's length), and reads per version from ``events.jsonl``:
the bytes written (disk: the version's files; delta: ``weights/written_bytes``), the learner's
``timing/publish_weights_s`` (gather, encode, write), the orchestrator's ``timing/sync_weights_s``
(pause, load into every engine, resume) and the fraction of elements whose bits changed.

While a run goes, every version directory it publishes is hard-linked aside (the orchestrator
prunes old ones), so that afterwards the delta run's versions are rebuilt (``deltas.rebuild``) and
two checks run on them:

- the other encoding, for the choice: sparse indices (gaps, zstd) and values (zstd) of the changed
  elements, bytes and encode seconds against XOR + zstd on the same versions;
- the chain is exact: the last version rebuilt from v0 and every delta equals, bit for bit, the
  run's final model (``final/``) in the engines' dtype.

    python benchmarks/bench_delta_sync.py --recipe recipes/tool_use.toml --init-from runs/tool_use/sft/final --steps 20
    python benchmarks/bench_delta_sync.py ... --set inference.engines=1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its neighbours import
from run_watch import Keeper, directory_bytes, per_step, rl_argv, versions, work_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = ("disk", "delta")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", type=Path, required=True)
    p.add_argument("--init-from", type=Path, required=True, help="the RL stage's starting model (an SFT final/)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--out", type=Path, default=None, help="keep the runs here (default: a temporary directory, removed at the end)"
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--skyrl", default=str(Path(sys.executable).with_name("skyrl")))
    return p.parse_args(argv)


def run_rl(args, mode: str, out: Path) -> Path:
    run_dir, kept = out / f"rl-{mode}", out / f"versions-{mode}"
    sets = [
        f"rl.init_from={args.init_from.resolve()}",
        f"rl.steps={args.steps}",
        "rl.eval_every=0",
        "rl.save_every=0",
        f'inference.weight_sync="{mode}"',
        *([f"inference.full_version_every={args.steps + 1}"] if mode == "delta" else []),
        *args.sets,
    ]
    argv = rl_argv(args.skyrl, args.recipe, run_dir, sets)
    with Keeper(run_dir / "weights", kept, versions):
        done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-8:])
        raise SystemExit(f"{' '.join(argv)} failed (exit {done.returncode}):\n{tail}")
    return run_dir


def sparse_encoding(previous: dict, current: dict) -> tuple[int, float]:
    """(bytes, seconds) of the changed elements as gaps between their indices and their values, zstd."""
    import numpy as np
    import torch
    import zstandard

    from backends.inference.deltas import as_ints

    compressor = zstandard.ZstdCompressor(level=3)
    started, total = time.perf_counter(), 0
    for name in sorted(current):
        now, before = as_ints(current[name]), as_ints(previous[name])
        index = torch.nonzero(now != before).flatten().numpy().astype(np.int64)
        gaps = np.diff(index, prepend=-1).astype(np.uint32)
        total += len(compressor.compress(gaps.tobytes())) + len(compressor.compress(now.numpy()[index].tobytes()))
    return total, time.perf_counter() - started


def xor_encoding_seconds(previous: dict, current: dict, scratch: Path) -> float:
    from backends.inference.deltas import write_delta

    scratch.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    write_delta(scratch, 1, 0, 0, previous, current)
    return time.perf_counter() - started


def encodings(kept: Path, final: Path | None, scratch: Path) -> dict:
    """Rebuild the delta run's versions in order, compare the encodings, check the last against
    ``final`` (None: no check, for a run that did not finish)."""
    import torch
    from transformers import AutoModelForCausalLM

    from backends.inference.deltas import apply_delta, as_ints, read_full
    from backends.models.tied import engine_state

    versions = sorted(int(p.name[1:]) for p in kept.iterdir())
    tensors = read_full(kept / f"v{versions[0]}")
    xor_bytes, sparse_bytes, xor_s, sparse_s = [], [], [], []
    for version in versions[1:]:
        current = apply_delta(kept / f"v{version}", version - 1, tensors)
        xor_bytes.append((kept / f"v{version}" / "delta.bin").stat().st_size)
        size, seconds = sparse_encoding(tensors, current)
        sparse_bytes.append(size)
        sparse_s.append(seconds)
        xor_s.append(xor_encoding_seconds(tensors, current, scratch / f"v{version}"))
        tensors = current
    exact = None
    if final is not None:
        dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
        model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32)
        expected = engine_state(model, dtype=str(dtype).removeprefix("torch."))
        exact = expected.keys() == tensors.keys() and all(
            torch.equal(as_ints(expected[k]), as_ints(tensors[k])) for k in tensors
        )
    return {
        "versions": versions,
        "xor_zstd_bytes": xor_bytes,
        "sparse_zstd_bytes": sparse_bytes,
        "xor_zstd_encode_s": xor_s,
        "sparse_zstd_encode_s": sparse_s,
        "last_version_equals_final_bitwise": exact,
    }


def med(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def summary(runs: dict[str, dict[int, dict[str, float]]], kept: dict[str, Path], steps: int) -> dict:
    out = {}
    for mode, rows in runs.items():
        versions = range(1, steps + 1)
        written = [
            directory_bytes(kept[mode] / f"v{v}") if mode == "disk" else rows.get(v, {}).get("weights/written_bytes")
            for v in versions
        ]
        out[mode] = {
            "written_bytes": written,
            "publish_s": [rows.get(v, {}).get("timing/publish_weights_s") for v in versions],
            "sync_s": [rows.get(v, {}).get("timing/sync_weights_s") for v in versions],
            "changed_fraction": [rows.get(v, {}).get("weights/changed_fraction") for v in versions],
            "full_bytes": rows.get(1, {}).get("weights/full_bytes"),
        }
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    with work_dir(args.out, "skyrl-delta-") as out:
        runs, kept, walls = {}, {}, {}
        for mode in MODES:
            started = time.monotonic()
            run_dir = run_rl(args, mode, out)
            walls[mode] = time.monotonic() - started
            runs[mode], kept[mode] = per_step(run_dir), out / f"versions-{mode}"
        figures = summary(runs, kept, args.steps)
        figures["encodings"] = encodings(kept["delta"], out / "rl-delta" / "final", out / "scratch")
    figures["wall_s"] = walls
    disk, delta, enc = figures["disk"], figures["delta"], figures["encodings"]
    print(f"versions 1-{args.steps}, medians:")
    print(f"  whole version             {delta['full_bytes'] / 1e6:10.2f} MB")
    print(f"  disk: written             {med(disk['written_bytes']) / 1e6:10.2f} MB")
    print(
        f"  delta: written            {med(delta['written_bytes']) / 1e6:10.2f} MB"
        f"  ({med(delta['written_bytes']) / med(disk['written_bytes']):.3f}x disk)"
    )
    print(f"  delta: elements changed   {med(delta['changed_fraction']):10.4f}")
    print(
        f"  sparse + zstd instead     {med(enc['sparse_zstd_bytes']) / 1e6:10.2f} MB"
        f"  ({med(enc['sparse_zstd_bytes']) / med(enc['xor_zstd_bytes']):.3f}x XOR + zstd);"
        f" encode {med(enc['sparse_zstd_encode_s']):.3f} s vs {med(enc['xor_zstd_encode_s']):.3f} s"
    )
    for key, label in (("publish_s", "learner publish"), ("sync_s", "engine sync")):
        ratio = med(delta[key]) / med(disk[key])
        print(f"  {label:25s} disk {med(disk[key]):.3f} s, delta {med(delta[key]):.3f} s ({ratio:.3f}x disk)")
    print(f"  last version rebuilt from v0 + deltas == final/ bit for bit: {enc['last_version_equals_final_bitwise']}")
    print(f"  wall time: disk {walls['disk']:.0f} s, delta {walls['delta']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
