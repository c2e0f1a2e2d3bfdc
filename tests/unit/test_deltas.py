"""Lossless delta versions (``backends.inference.deltas``): the bits XOR the version before, one
zstd frame per tensor, a CRC-32 per tensor of the result; a version rebuilt from its last whole
version and the deltas since; every way a delta can fail to give its version is a ``DeltaError``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from backends.inference.deltas import (
    BLOB,
    MANIFEST,
    DeltaError,
    apply_delta,
    as_ints,
    chain,
    crc32,
    is_delta,
    rebuild,
    write_delta,
)


def bits(tensor: torch.Tensor) -> list[int]:
    return as_ints(tensor).tolist()


def test_an_unchanged_element_is_zero_bits_and_a_changed_one_its_xor(tmp_path):
    before = {"w": torch.tensor([1.0, 2.0, -3.0], dtype=torch.bfloat16)}
    after = {"w": torch.tensor([1.0, 2.015625, -3.0], dtype=torch.bfloat16)}  # 2.0 + one bf16 ulp (2**-6)
    stats = write_delta(tmp_path, 1, 0, 0, before, after)
    assert (stats.changed, stats.elements, stats.full_bytes) == (1, 3, 6)
    assert bits(before["w"])[1] ^ bits(after["w"])[1] == 1  # the lowest mantissa bit
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["base"] == 0 and manifest["tensors"][0]["crc32"] == crc32(after["w"])
    got = apply_delta(tmp_path, 0, before)
    assert bits(got["w"]) == bits(after["w"]) and bits(before["w"]) != bits(after["w"])  # base untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_twenty_versions_apply_to_the_last_bit_and_rebuild_from_the_whole_one(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    master = {"a.weight": torch.randn(64, 32, generator=gen), "b.bias": torch.randn(7, generator=gen)}
    versions = []
    for version in range(21):
        if version:
            for tensor in master.values():
                tensor.add_(torch.randn(tensor.shape, generator=gen).sign() * 1e-4)
        versions.append({k: v.to(dtype, copy=True) for k, v in master.items()})
        out = tmp_path / f"v{version}"
        out.mkdir()
        if version == 0:
            save_file(versions[0], str(out / "model.safetensors"))
        else:
            write_delta(out, version, version - 1, 0, versions[-2], versions[-1])
            applied = apply_delta(out, version - 1, versions[-2])
            assert all(bits(applied[k]) == bits(versions[-1][k]) for k in master)
    version, rebuilt = rebuild(tmp_path / "v20")
    assert version == 20 and all(bits(rebuilt[k]) == bits(versions[20][k]) for k in master)
    assert chain(tmp_path / "v20") == range(0, 21) and chain(tmp_path / "v0") == range(0, 1)
    assert is_delta(tmp_path / "v3") and not is_delta(tmp_path / "v0")
    # versions skipped (--async loads the newest): from the version held, through the deltas between
    (tmp_path / "v0" / "model.safetensors").unlink()
    version, advanced = rebuild(tmp_path / "v20", (15, versions[15]))
    assert version == 20 and all(bits(advanced[k]) == bits(versions[20][k]) for k in master)
    with pytest.raises(DeltaError, match="no weights"):  # a version held off the chain is not used
        rebuild(tmp_path / "v20", (25, versions[20]))


@pytest.fixture
def one_delta(tmp_path):
    before = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    after = {"w": before["w"] + 0.5}
    (tmp_path / "v0").mkdir()
    save_file(before, str(tmp_path / "v0" / "model.safetensors"))
    (tmp_path / "v1").mkdir()
    write_delta(tmp_path / "v1", 1, 0, 0, before, after)
    return tmp_path / "v1", before


def test_a_delta_for_another_base_is_refused(one_delta):
    directory, before = one_delta
    with pytest.raises(DeltaError, match="a delta against v0, the base held is v3"):
        apply_delta(directory, 3, before)
    with pytest.raises(DeltaError, match="does not check out"):  # right number, wrong tensors
        apply_delta(directory, 0, {"w": before["w"] + 1})


def test_a_corrupt_or_missing_delta_is_refused_never_applied(one_delta):
    directory, before = one_delta
    blob = directory / BLOB
    good = blob.read_bytes()
    blob.write_bytes(good[:-3])
    with pytest.raises(DeltaError, match="w: "):
        apply_delta(directory, 0, before)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["tensors"][0]["crc32"] ^= 1
    (directory / MANIFEST).write_text(json.dumps(manifest))
    blob.write_bytes(good)
    with pytest.raises(DeltaError, match="does not check out"):
        apply_delta(directory, 0, before)
    blob.unlink()
    with pytest.raises(DeltaError, match=BLOB):
        rebuild(directory)


def test_a_delta_whose_tensors_differ_from_its_base_is_not_written(tmp_path):
    with pytest.raises(DeltaError, match="the tensors differ"):
        write_delta(tmp_path, 1, 0, 0, {"a": torch.zeros(2)}, {"b": torch.zeros(2)})
    with pytest.raises(DeltaError, match="float32"):
        write_delta(tmp_path, 1, 0, 0, {"a": torch.zeros(2)}, {"a": torch.zeros(2, dtype=torch.bfloat16)})
