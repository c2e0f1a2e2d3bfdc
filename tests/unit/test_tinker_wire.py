"""Protobuf bodies through the SDK's own encoder (request_conv) and decoder (response_conv)."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from backends.tinker.wire import (
    Sampled,
    WireError,
    decode_forward_backward,
    decompress,
    encode_forward_backward_output,
    encode_sample_response,
    proto_result_as_json,
)


def sdk_body(data, loss_fn="cross_entropy", config=None, seq_id=1) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def decode(body, **kw):
    return decode_forward_backward(body, **{"max_datums": 16, "max_tokens": 64, "vocab_size": 100, **kw})


def test_decodes_what_the_sdk_encodes():
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, -0.5, 0.0]},
    )
    fb = decode(sdk_body([datum], "ppo", {"clip_low_threshold": 0.9, "tag": "x"}, seq_id=7))
    assert (fb.model_id, fb.seq_id, fb.loss_fn, fb.forward_only) == ("s:train:0", 7, "ppo", False)
    assert fb.config == {"clip_low_threshold": 0.9, "tag": "x"}
    (d,) = fb.data
    assert d.tokens == [1, 2, 3]
    assert d.inputs["target_tokens"].tolist() == [2, 3, 4] and d.inputs["target_tokens"].dtype == np.int64
    assert d.inputs["weights"].tolist() == [1.0, -0.5, 0.0]


def test_sparse_inputs_are_densified():
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([5, 6, 7], np.int32).tobytes()
    tensor = datum.loss_fn_inputs["target_tokens"]
    tensor.dtype = pb.DTYPE_INT64
    tensor.dense = np.array([6, 7, 8], np.int64).tobytes()
    w = datum.loss_fn_inputs["weights"]
    w.dtype = pb.DTYPE_FLOAT32
    w.shape.extend([1, 3])
    w.sparse_csr.values = np.array([2.0], np.float32).tobytes()
    w.sparse_csr.crow_indices = np.array([0, 1], np.int64).tobytes()
    w.sparse_csr.col_indices = np.array([1], np.int64).tobytes()
    (d,) = decode(msg.SerializeToString()).data
    assert d.inputs["weights"].tolist() == [0.0, 2.0, 0.0]
    w.shape[:] = [2, 3]
    with pytest.raises(WireError, match="malformed sparse"):
        decode(msg.SerializeToString())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: setattr(m, "seq_id", 0), "seq_id must be >= 1"),
        (lambda m: m.ClearField("data"), "no datums"),
        (lambda m: m.data[0].loss_fn_inputs["weights"].__setattr__("dense", b"\x00" * 4), "does not match 1 values"),
        (
            lambda m: (
                m.data[0].model_input[0].encoded_text.__setattr__("tokens", np.array([1, 2, 999], np.int32).tobytes())
            ),
            "token ids must be in",
        ),
        (
            lambda m: (
                m.data[0].loss_fn_inputs["weights"].__setattr__("dense", np.array([1, np.nan, 1], np.float32).tobytes())
            ),
            "NaN",
        ),
        (lambda m: m.data[0].loss_fn_inputs["weights"].__setattr__("dense", b"\x00" * 5), "not a multiple"),
        (lambda m: m.data[0].model_input.add().image.__setattr__("data", b"png"), "'image' is not supported"),
    ],
)
def test_malformed_requests_name_the_problem(mutate, message):
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(sdk_body([datum]))
    mutate(msg)
    with pytest.raises(WireError, match=message):
        decode(msg.SerializeToString())


def test_limits_and_garbage():
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10))), loss_fn_inputs={"target_tokens": list(range(10))}
    )
    with pytest.raises(WireError, match="over the limit") as err:
        decode(sdk_body([datum] * 3), max_datums=2)
    assert err.value.status == 413
    with pytest.raises(WireError, match="10 tokens is over the limit of 5"):
        decode(sdk_body([datum]), max_tokens=5)
    with pytest.raises(WireError, match="not a tinker ForwardBackwardRequest"):
        decode(b"\xff\xff\xff garbage")


def test_zstd_and_its_bomb_guard():
    import zstandard

    payload = b"x" * 10_000
    packed = zstandard.ZstdCompressor().compress(payload)
    assert decompress(packed, "zstd", 20_000) == payload
    with pytest.raises(WireError) as err:
        decompress(packed, "zstd", 1_000)
    assert err.value.status == 413
    with pytest.raises(WireError, match="not valid zstd"):
        decompress(b"nope", "zstd", 1_000)
    with pytest.raises(WireError, match="gzip"):
        decompress(b"", "gzip", 10)


def test_outputs_decode_with_the_sdk():
    lp = [np.array([-1.0, -2.0], np.float32), np.array([-0.5], np.float32)]
    data = encode_forward_backward_output({"logprobs": lp, "elementwise_loss": [-x for x in lp]}, 2, {"loss:sum": 3.5})
    out = deserialize_forward_backward_output(data)
    assert out.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert proto_result_as_json("forward_backward", data)["loss_fn_outputs"][1]["logprobs"]["data"] == [-0.5]

    sample = encode_sample_response([Sampled([3, 4], [-0.1, -0.2], "length"), Sampled([5], None, "stop")], [None, -1.5])
    resp = deserialize_sample_response(sample)
    assert [list(s.tokens) for s in resp.sequences] == [[3, 4], [5]]
    assert [s.stop_reason for s in resp.sequences] == ["length", "stop"]
    assert resp.sequences[0].logprobs == pytest.approx([-0.1, -0.2])
    assert resp.prompt_logprobs[0] is None and resp.prompt_logprobs[1] == pytest.approx(-1.5)
    assert proto_result_as_json("sample", sample)["prompt_logprobs"] == [None, -1.5]
