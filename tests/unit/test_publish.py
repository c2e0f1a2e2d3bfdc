"""The learner's weight publishers (``backends.train.publish``): one per transport, chosen from the
plan's ``weight_sync``; who writes, who joins the gather, what goes as files under NCCL."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from backends.inference.transports.publishers import FilePublisher, NcclFirstVersionAsFiles
from backends.train.publish import weight_publisher


class Exchange:
    def __init__(self, tmp_path):
        self.root, self.published = tmp_path, []

    @contextmanager
    def publish_weights(self, version):
        out = self.root / f"v{version}"
        out.mkdir()
        yield out
        self.published.append(version)


def rank(main: bool):
    return SimpleNamespace(is_main=main)


def recipe(zero_stage=2):
    return SimpleNamespace(trainer=SimpleNamespace(zero_stage=zero_stage), quantization=None)


class Export:
    def __init__(self):
        self.calls = []

    def for_engines(self, out):
        self.calls.append(("full", out))

    def int4_for_engines(self, out, cfg):
        self.calls.append(("int4", out))

    def adapter(self, out):
        self.calls.append(("adapter", out))


def test_rank_0_writes_and_others_join_the_gather_only_under_zero_3(tmp_path):
    export, exchange = Export(), Exchange(tmp_path)
    assert FilePublisher(exchange, rank(True), export.for_engines, collective=False).publish(1) is None
    assert exchange.published == [1] and export.calls == [("full", tmp_path / "v1")]
    FilePublisher(exchange, rank(False), export.for_engines, collective=True).publish(2)
    FilePublisher(exchange, rank(False), export.for_engines, collective=False).publish(3)
    assert export.calls[1:] == [("full", None)] and exchange.published == [1]


class Sender:
    def __init__(self):
        self.sent = []

    def publish(self, version):
        self.sent.append(version)
        return 0.25


def test_nccl_sends_every_version_but_the_first_which_goes_as_files(tmp_path):
    export, exchange, sender = Export(), Exchange(tmp_path), Sender()
    files = FilePublisher(exchange, rank(True), export.for_engines, collective=False)
    nccl = NcclFirstVersionAsFiles(sender, files, first_version=4)
    assert nccl.publish(4) is None and nccl.publish(5) == 0.25 and nccl.publish(6) == 0.25
    assert exchange.published == [4] and sender.sent == [5, 6]
    fallback = NcclFirstVersionAsFiles(None, files, first_version=0)  # the group could not be set up
    assert fallback.publish(7) is None and exchange.published == [4, 7]


@pytest.mark.parametrize(
    "weight_sync, kind", [("disk", "full"), ("lora", "adapter"), ("nccl", "full"), ("int4", "int4")]
)
def test_the_plans_transport_picks_the_publisher(tmp_path, weight_sync, kind):
    export, exchange = Export(), Exchange(tmp_path)
    publisher = weight_publisher(weight_sync, exchange, rank(True), export, recipe(), 0, sender=None)
    publisher.publish(0)
    assert export.calls == [(kind, tmp_path / "v0")]
