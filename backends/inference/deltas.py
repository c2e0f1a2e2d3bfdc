"""Policy versions as lossless deltas: the bits that changed since the version before, compressed.

A delta version's directory (``weights/v<k>/``) holds ``delta.json`` (the manifest) and
``delta.bin`` (one zstd frame per tensor, in the manifest's order). A tensor's frame is the XOR of
its bit pattern with the same tensor in version ``base`` (the version before), viewed as integers
of the element's width: an element that did not change is zero, one whose low mantissa bits moved
is a small integer, and zstd packs both (``benchmarks/bench_delta_sync.py`` measures this against
sparse indices and values; docs/gpus.md, "Delta weight sync"). The manifest holds each tensor's CRC-32 after
the delta is applied, so a reader that ends with other bytes (a corrupt or missing file, a delta
applied to the wrong base) finds out before any engine loads it.

Every ``full_every`` versions, and at the first version a learner publishes, the version is
written whole instead (HF safetensors, ``backends.models.tied.save_for_engines``); the manifest
names that ``full`` version, so a reader holding no base (a restarted engine, an engine that
missed a version) rebuilds version ``k`` from ``full`` and the deltas after it (``rebuild``).

Pure functions over ``{name: tensor}`` in the engines' dtype; the learner's side is
``backends.inference.transports.delta``, the engine's ``backends.inference.delta_worker``.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from skyrl_contracts.transports import DELTA_MANIFEST

if TYPE_CHECKING:
    import torch

MANIFEST = DELTA_MANIFEST
BLOB = "delta.bin"
ENCODING = "xor-zstd"
WORKERS = min(16, os.cpu_count() or 1)
ZSTD_LEVEL = 1  # on a 0.5B embedding's delta (3% changed): the same 9.7 MB as level 3, in 0.62 s instead of 0.84


def int_view(element_size: int):
    """The integer dtype of an element width: XOR needs an integer view of the same size."""
    import torch  # lazy: the orchestrator reads manifests (``chain``) without torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[element_size]


class DeltaError(Exception):
    """A delta that cannot give the version it names: missing, corrupt, or not for this base."""


@dataclass(frozen=True)
class DeltaStats:
    full_bytes: int  # the version's tensors, whole, in their dtype
    delta_bytes: int  # delta.bin
    changed: int  # elements whose bits changed
    elements: int

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def as_ints(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(int_view(flat.element_size()))


def crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(as_ints(tensor).numpy().view("uint8"))


def is_delta(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


def read_manifest(directory: str | Path) -> dict:
    try:
        return json.loads((Path(directory) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DeltaError(f"{Path(directory) / MANIFEST}: {err}") from None


def write_delta(
    directory: Path, version: int, base: int, full: int, previous: Mapping[str, torch.Tensor],
    current: Mapping[str, torch.Tensor],
) -> DeltaStats:  # fmt: skip
    """Write ``current`` as a delta against ``previous`` (version ``base``) into ``directory``. Tensors
    are encoded in parallel (torch, zstd and CRC-32 release the GIL): at 7B a single core would
    spend tens of seconds a version."""
    if previous.keys() != current.keys():
        raise DeltaError(
            f"v{version}: the tensors differ from v{base}'s: {sorted(previous.keys() ^ current.keys())[:5]}"
        )
    names = sorted(current)
    for name in names:
        now, before = current[name], previous[name]
        if now.dtype != before.dtype or now.shape != before.shape:
            raise DeltaError(
                f"v{version}: {name} is {now.dtype} {tuple(now.shape)}, v{base} had {before.dtype} {tuple(before.shape)}"
            )
    with ThreadPoolExecutor(WORKERS) as pool:
        encoded = list(pool.map(lambda name: encode_tensor(previous[name], current[name]), names))
    entries, offset, changed, elements, full_bytes = [], 0, 0, 0, 0
    with open(directory / BLOB, "wb") as blob:
        for name, (frame, changes, checksum) in zip(names, encoded):
            now = current[name]
            blob.write(frame)
            changed += changes
            elements += now.numel()
            full_bytes += now.numel() * now.element_size()
            entries.append(
                {
                    "name": name, "dtype": str(now.dtype).removeprefix("torch."), "shape": list(now.shape),
                    "offset": offset, "length": len(frame), "crc32": checksum,
                }
            )  # fmt: skip
            offset += len(frame)
    manifest = {"version": version, "base": base, "full": full, "encoding": ENCODING, "tensors": entries}
    (directory / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    return DeltaStats(full_bytes, offset, changed, elements)


def encode_tensor(before: torch.Tensor, now: torch.Tensor) -> tuple[bytes, int, int]:
    """(the zstd frame of the XOR of the bits, elements changed, CRC-32 of ``now``)."""
    import torch  # lazy: as int_view
    import zstandard  # lazy: the learner and the engines only

    xor = torch.bitwise_xor(as_ints(now), as_ints(before))
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(xor.numpy())
    return frame, int(torch.count_nonzero(xor)), crc32(now)


def apply_delta(directory: str | Path, base_version: int, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The version in ``directory``, from ``base`` (version ``base_version``); new tensors, ``base``
    untouched. ``DeltaError`` where the delta is not for this base or any tensor's CRC differs.
    Tensors are decoded in parallel, as ``write_delta`` encodes them."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest.get("encoding") != ENCODING:
        raise DeltaError(f"{directory}: unknown encoding {manifest.get('encoding')!r}")
    if manifest["base"] != base_version:
        raise DeltaError(f"{directory}: a delta against v{manifest['base']}, the base held is v{base_version}")
    try:
        raw = (directory / BLOB).read_bytes()
    except OSError as err:
        raise DeltaError(f"{directory / BLOB}: {err}") from None
    entries = manifest["tensors"]
    missing = [e["name"] for e in entries if e["name"] not in base]
    if missing:
        raise DeltaError(f"{directory}: {missing[0]} is not in v{base_version}")
    if len(entries) != len(base):
        raise DeltaError(f"{directory}: names {len(entries)} tensors, v{base_version} has {len(base)}")

    def decode(entry: dict):
        return decode_tensor(directory, entry, raw, base[entry["name"]])

    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(zip((e["name"] for e in entries), pool.map(decode, entries)))


def decode_tensor(directory: Path, entry: dict, raw: bytes, before: torch.Tensor) -> torch.Tensor:
    import torch  # lazy: as int_view
    import zstandard  # lazy: as encode_tensor

    name = entry["name"]
    frame = memoryview(raw)[entry["offset"] : entry["offset"] + entry["length"]]
    try:
        xor = zstandard.ZstdDecompressor().decompress(frame, max_output_size=before.numel() * before.element_size())
    except zstandard.ZstdError as err:
        raise DeltaError(f"{directory / BLOB}: {name}: {err}") from None
    bits = torch.frombuffer(bytearray(xor), dtype=int_view(before.element_size()))
    if bits.numel() != before.numel():
        raise DeltaError(f"{directory / BLOB}: {name}: {bits.numel()} elements, the base has {before.numel()}")
    now = torch.bitwise_xor(bits, as_ints(before)).view(before.dtype).reshape(before.shape)
    if crc32(now) != entry["crc32"]:
        raise DeltaError(f"{directory}: {name} does not check out (CRC-32) after the delta")
    return now


def read_full(directory: str | Path) -> dict[str, torch.Tensor]:
    """A full version's tensors (every ``*.safetensors`` of the directory)."""
    from safetensors.torch import load_file  # lazy: only readers of full versions need it

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise DeltaError(f"{directory}: no weights (neither {MANIFEST} nor *.safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def version_dir(directory: str | Path, version: int) -> Path:
    """Version ``version``'s directory beside ``directory`` (``weights/v<k>``)."""
    return Path(directory).parent / f"v{version}"


def rebuild(directory: str | Path, held: tuple[int, dict] | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """(the version, its tensors) of ``directory``, a full version or a delta: from ``held`` (a
    version and its tensors) where that version is on the delta's chain, else from the chain's whole
    version, then every delta after it in order. ``DeltaError`` names the first file that does not
    check out."""
    directory = Path(directory)
    if not is_delta(directory):
        return int(directory.name.removeprefix("v")), read_full(directory)
    target = read_manifest(directory)
    if held is not None and target["full"] <= held[0] <= target["version"]:
        version, tensors = held
    else:
        version, tensors = target["full"], read_full(version_dir(directory, target["full"]))
    while version < target["version"]:
        step = version_dir(directory, version + 1)
        tensors = apply_delta(step, version, tensors)
        version += 1
    return version, tensors


def chain(directory: str | Path) -> range:
    """The versions that ``rebuild(directory)`` reads: their directories must stay."""
    directory = Path(directory)
    if not is_delta(directory):
        version = int(directory.name.removeprefix("v"))
        return range(version, version + 1)
    manifest = read_manifest(directory)
    return range(manifest["full"], manifest["version"] + 1)
