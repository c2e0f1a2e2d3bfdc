"""Binary bodies of the Tinker protocol, through the protobuf module shipped in the ``tinker`` SDK
(``tinker.proto.tinker_public_pb2``; never a copy of it).

- ``decode_forward_backward``: a ``ForwardBackwardRequest`` body (optionally zstd) into plain
  Python values, checked (``WireError`` -> 400/413 naming the problem);
- ``encode_forward_backward_output`` / ``encode_sample_response``: the two results the SDK only
  accepts as protobuf (``Accept: application/x-protobuf``); a sample's prompt logprobs, NaN where
  a position is not scored, and its top-k prompt logprobs as a ``TopkLogprobs`` matrix (rows
  padded with the SDK's empty fill).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import zstandard
from google.protobuf.message import DecodeError

PROTO_CONTENT_TYPE = "application/x-protobuf"
FLOAT_INPUTS = ("weights", "logprobs", "advantages", "clip_low_threshold", "clip_high_threshold")


class WireError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _pb():
    # lazy: tinker SDK (3.7 s); only the protobuf wire format needs it
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, np.ndarray]  # loss_fn_inputs by name, 1-D, one entry per input token


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    data: list[Datum]
    config: dict[str, float | str] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(d.tokens) for d in self.data)


def decompress(body: bytes, encoding: str | None, max_bytes: int) -> bytes:
    """The body after its ``Content-Encoding`` (identity or zstd), at most ``max_bytes``."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        data = body
    elif encoding == "zstd":
        data = _unzstd(body, max_bytes)
    else:
        raise WireError(f"Content-Encoding {encoding!r} is not supported (identity or zstd)", 415)
    if len(data) > max_bytes:
        raise WireError(f"request body over the limit of {max_bytes} bytes (tinker.max_request_bytes)", 413)
    return data


# zstd's densest block (RLE) turns 4 bytes into 128 KiB: feeding the decompressor at most
# (room left) / ratio compressed bytes at a time keeps each step's output within the room left.
_ZSTD_MAX_RATIO = 1 << 15
_ZSTD_MIN_STEP = 64
_ZSTD_MAX_FRAMES = 1024  # the SDK sends one; millions of empty 9-byte frames would hold the loop for seconds


def _unzstd(body: bytes, max_bytes: int) -> bytes:
    """Every frame of a zstd body, decompressed a step at a time: a bomb is stopped as soon as it
    passes ``max_bytes`` (not once it has expanded); a cut-off frame or junk after one is an error
    (``stream_reader`` read only the first frame and took a truncated one as a shorter body)."""
    too_big = WireError(f"request body over the limit of {max_bytes} bytes (tinker.max_request_bytes)", 413)
    dctx = zstandard.ZstdDecompressor()
    view, pos, parts, size = memoryview(body), 0, [], 0
    frames = 0
    while pos < len(view):  # a frame per round: a body may hold several
        frames += 1
        if frames > _ZSTD_MAX_FRAMES:
            raise WireError(f"zstd body of more than {_ZSTD_MAX_FRAMES} frames")
        frame = dctx.decompressobj()
        while not frame.eof:
            if pos >= len(view):
                raise WireError("zstd body is truncated: its last frame is incomplete")
            step = view[pos : pos + max(_ZSTD_MIN_STEP, (max_bytes - size) // _ZSTD_MAX_RATIO)]
            try:
                data = frame.decompress(step)
            except zstandard.ZstdError as err:
                raise WireError(f"body is not valid zstd at byte {pos}: {err}") from None
            pos += len(step) - len(frame.unused_data)  # the next frame's start, once this one ended
            size += len(data)
            if size > max_bytes:
                raise too_big
            parts.append(data)
    return b"".join(parts)


_NP = {1: np.float32, 2: np.int64, 3: np.int32}
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _tensor(name: str, msg, tokens: int) -> np.ndarray:
    """A loss input as a 1-D array; its shape is checked before anything is allocated from it."""
    dtype = _NP.get(msg.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}]: dtype {msg.dtype} is not supported (float32 or int64)")
    shape = [int(s) for s in msg.shape]
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = _frombuffer(name, csr.values, dtype)
        crow = _frombuffer(name, csr.crow_indices, np.int64)
        col = _frombuffer(name, csr.col_indices, np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise WireError(f"loss_fn_inputs[{name!r}]: malformed sparse tensor")
        if min(shape) < 0 or shape[0] * shape[1] > max(tokens, 1):  # before allocating it
            raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} does not fit a datum of {tokens} tokens")
        dense = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            lo, hi = int(crow[row]), int(crow[row + 1])
            if not 0 <= lo <= hi <= len(col) or (hi > lo and (col[lo:hi].min() < 0 or col[lo:hi].max() >= shape[1])):
                raise WireError(f"loss_fn_inputs[{name!r}]: sparse indices out of range")
            dense[row, col[lo:hi]] = values[lo:hi]
        array = dense
    else:
        array = _frombuffer(name, msg.dense, dtype)
        if shape:
            # math.prod, not np.prod: int64 wraps around (2**32 x 2**32 "holds" 0 values); and -1
            # dimensions, which reshape would infer
            if min(shape) < 0 or math.prod(shape) != array.size:
                raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} does not match {array.size} values")
            array = array.reshape(shape)
    if array.ndim == 2 and array.shape[0] == 1:  # a sparse row vector
        array = array[0]
    if array.ndim != 1:
        raise WireError(
            f"loss_fn_inputs[{name!r}]: only 1-D (per-token) inputs are supported, got shape {list(array.shape)}"
        )
    return array


def _frombuffer(name: str, data: bytes, dtype) -> np.ndarray:
    if len(data) % np.dtype(dtype).itemsize:
        raise WireError(f"loss_fn_inputs[{name!r}]: byte length {len(data)} is not a multiple of its dtype size")
    return np.frombuffer(data, dtype=dtype)


def decode_forward_backward(
    body: bytes, *, max_datums: int, max_tokens: int | None, vocab_size: int
) -> ForwardBackward:
    """Parse and check a ``ForwardBackwardRequest``; every datum's inputs match its length."""
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except (DecodeError, ValueError) as err:
        raise WireError(f"body is not a tinker ForwardBackwardRequest protobuf: {err}") from None
    if not msg.model_id:
        raise WireError("model_id is missing")
    if msg.seq_id < 1:
        raise WireError(f"seq_id must be >= 1, got {msg.seq_id}")
    if not msg.data:
        raise WireError("no datums")
    if len(msg.data) > max_datums:
        raise WireError(
            f"{len(msg.data)} datums is over the limit of {max_datums} (tinker.max_datums_per_request)", 413
        )
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        which = value.WhichOneof("value")
        config[key] = value.text if which == "text" else float(value.number)
    for key, value in config.items():  # a NaN clip bound makes every loss and gradient NaN
        # loss_fn_config_v2's numbers are doubles; the losses compute in float32, where 1e300 overflows
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            raise WireError(f"loss_fn_config[{key!r}] is {value}: it must be a finite number within float32's range")
    data = []
    for index, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"datum {index}: model_input chunk type {kind!r} is not supported (text tokens only)")
            tokens.extend(_frombuffer("model_input", chunk.encoded_text.tokens, np.int32).tolist())
        if not tokens:
            raise WireError(f"datum {index}: empty model_input")
        if max_tokens is not None and len(tokens) > max_tokens:
            raise WireError(f"datum {index}: {len(tokens)} tokens is over the limit of {max_tokens}", 413)
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            raise WireError(f"datum {index}: token ids must be in 0..{vocab_size - 1}")
        inputs = {}
        for name, tensor in datum.loss_fn_inputs.items():
            array = _tensor(name, tensor, len(tokens))
            if len(array) != len(tokens):
                raise WireError(
                    f"datum {index}: loss_fn_inputs[{name!r}] has {len(array)} entries for {len(tokens)} input tokens"
                )
            if name == "target_tokens":
                array = array.astype(np.int64)
                if len(array) and (array.min() < 0 or array.max() >= vocab_size):
                    raise WireError(f"datum {index}: target_tokens must be in 0..{vocab_size - 1}")
            else:
                array = array.astype(np.float32)
                if not np.all(np.isfinite(array)):
                    raise WireError(f"datum {index}: loss_fn_inputs[{name!r}] holds NaN or infinity")
            inputs[name] = array
        data.append(Datum(tokens, inputs))
    return ForwardBackward(msg.model_id, int(msg.seq_id), msg.loss_fn, bool(msg.forward_only), data, config)


def _batched(arrays: list[np.ndarray], dtype_code: int, np_dtype):
    pb = _pb()
    parts = [np.ascontiguousarray(a, dtype=np_dtype) for a in arrays]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([p.nbytes for p in parts])
    return pb.BatchedTensor(data=b"".join(p.tobytes() for p in parts), offsets=offsets.tobytes(), dtype=dtype_code)


def encode_forward_backward_output(
    fields: dict[str, list[np.ndarray]], num_datums: int, metrics: dict[str, float]
) -> bytes:
    """``ForwardBackwardOutput``: one ArrayRecord with float32 per-datum arrays per field."""
    pb = _pb()
    record = pb.ArrayRecord(num_datums=num_datums)
    for name, arrays in fields.items():
        record.fields[name].CopyFrom(_batched(arrays, pb.DTYPE_FLOAT32, np.float32))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={k: float(v) for k, v in metrics.items()})
    out.loss_fn_outputs.append(record)
    return out.SerializeToString()


def decode_forward_backward_output(data: bytes):
    """(field -> per-datum arrays, metrics): the inverse of ``encode_forward_backward_output``."""
    pb = _pb()
    out = pb.ForwardBackwardOutput()
    out.ParseFromString(data)
    fields: dict[str, list[np.ndarray]] = {}
    for record in out.loss_fn_outputs:
        for name, bt in record.fields.items():
            offsets = np.frombuffer(bt.offsets, dtype=np.int64)
            buf = np.frombuffer(bt.data, dtype=np.float32)
            fields.setdefault(name, []).extend(
                buf[offsets[i] // 4 : offsets[i + 1] // 4] for i in range(len(offsets) - 1)
            )
    return fields, dict(out.metrics)


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: str  # "stop" | "length"


# the SDK's fill for a top-k row with nothing in it (tinker.types.topk_logprobs: token 0, MASK_LOGPROB)
TOPK_EMPTY = (0, -99999.0)


@dataclass
class PromptScores:
    """What a sample request asked of its prompt, one entry per prompt position (None where not
    scored: position 0 always, and the positions before ``prompt_logprobs_last_n``)."""

    logprobs: list[float | None] | None  # the prompt token's logprob (``prompt_logprobs``)
    topk: list[list[tuple[int, float]] | None] | None  # the k most likely (token, logprob), best first
    k: int = 0  # ``topk_prompt_logprobs``


def _fill_topk(msg, rows: list[list[tuple[int, float]] | None], k: int) -> None:
    ids = np.full((len(rows), k), TOPK_EMPTY[0], dtype=np.int32)
    lps = np.full((len(rows), k), TOPK_EMPTY[1], dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = token, logprob
    msg.token_ids, msg.logprobs, msg.k, msg.length = ids.tobytes(), lps.tobytes(), k, len(rows)


def encode_sample_response(
    sequences: list[Sampled],
    prompt_logprobs: list[float | None] | None,
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None,
    k: int = 0,
) -> bytes:
    pb = _pb()
    out = pb.SampleResponse()
    for seq in sequences:
        item = out.sequences.add()
        item.stop_reason = pb.STOP_REASON_LENGTH if seq.stop_reason == "length" else pb.STOP_REASON_STOP
        item.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        if seq.logprobs is not None:
            item.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if topk_prompt_logprobs is not None and k > 0:
        _fill_topk(out.topk_prompt_logprobs, topk_prompt_logprobs, k)
    return out.SerializeToString()


def encode_sample_result(sequences: list[Sampled], prompt: PromptScores | None) -> bytes:
    if prompt is None:
        return encode_sample_response(sequences, None)
    return encode_sample_response(sequences, prompt.logprobs, prompt.topk, prompt.k)


def proto_result_as_json(kind: str, data: bytes) -> dict:
    """A protobuf result for a client that did not ask for protobuf (curl, scripts)."""
    if kind == "sample":
        pb = _pb()
        msg = pb.SampleResponse()
        msg.ParseFromString(data)
        out: dict = {"type": "sample", "sequences": []}
        for seq in msg.sequences:
            out["sequences"].append(
                {
                    "stop_reason": "length" if seq.stop_reason == pb.STOP_REASON_LENGTH else "stop",
                    "tokens": np.frombuffer(seq.tokens, dtype=np.int32).tolist(),
                    "logprobs": np.frombuffer(seq.logprobs, dtype=np.float32).tolist() if seq.logprobs else None,
                }
            )
        if msg.HasField("prompt_logprobs"):
            values = np.frombuffer(msg.prompt_logprobs, dtype=np.float32).tolist()
            out["prompt_logprobs"] = [None if math.isnan(v) else v for v in values]
        if msg.HasField("topk_prompt_logprobs"):
            topk = msg.topk_prompt_logprobs
            ids = np.frombuffer(topk.token_ids, dtype=np.int32).reshape(topk.length, topk.k).tolist()
            lps = np.frombuffer(topk.logprobs, dtype=np.float32).reshape(topk.length, topk.k).tolist()
            rows = [[(t, v) for t, v in zip(i, p) if (t, v) != TOPK_EMPTY] for i, p in zip(ids, lps)]
            out["topk_prompt_logprobs"] = [[list(pair) for pair in row] or None for row in rows]
        return out
    fields, metrics = decode_forward_backward_output(data)
    n = len(next(iter(fields.values()))) if fields else 0
    outputs = [
        {
            name: {"data": arrays[i].tolist(), "dtype": "float32", "shape": [len(arrays[i])]}
            for name, arrays in fields.items()
        }
        for i in range(n)
    ]
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": metrics}
