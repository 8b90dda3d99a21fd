"""The Tinker SDK's wire formats: its JSON requests checked through the SDK's own pydantic types
(a bad field is a 400 naming it), its protobuf forward/backward request decoded into `Datum`s,
and the two protobuf answers the SDK asks for (`SampleResponse`, `ForwardBackwardOutput`).

Tensors on the wire: token ids int32, `loss_fn_inputs` float32 / int64 (dense, or sparse CSR,
which is refused: no built-in loss takes one), outputs as one `ArrayRecord` of float32 fields
with per-datum byte offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

from typing import TYPE_CHECKING

import numpy as np
import pydantic

from ridgeline.inference.request_fields import RequestError

if TYPE_CHECKING:
    from tinker.proto import tinker_public_pb2

M = TypeVar("M", bound=pydantic.BaseModel)

PROTO_MEDIA_TYPE = "application/x-protobuf"


def _pb():
    """The SDK's protobuf messages (the `tinker` extra: imported where a request needs them)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def parse(model: type[M], body: dict) -> M:
    """`body` as the SDK's request type `model`; the first invalid field is named (400)."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        raise RequestError(f"{model.__name__}: field {field!r}: {first['msg']}", field) from None


@dataclass(frozen=True)
class Datum:
    """One training sequence: `tokens` [N] (position i predicts `inputs["target_tokens"][i]`) and
    the loss inputs, each [N] (float32 or int64)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class ForwardBackward:
    model_id: str
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool


def _tensor(msg: tinker_public_pb2.Tensor, field: str) -> np.ndarray:
    if msg.HasField("sparse_csr"):
        raise RequestError(f"{field}: sparse tensors are not served; send a dense tensor", field)
    pb = _pb()
    dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}.get(msg.dtype)
    if dtype is None:
        raise RequestError(f"{field}: dtype {msg.dtype} is not float32 / int64", field)
    data = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape) or [data.size]
    if math.prod(shape) != data.size:
        raise RequestError(f"{field}: shape {shape} does not hold {data.size} values", field)
    if len(shape) != 1:
        raise RequestError(f"{field}: shape {shape}: built-in losses take one value per position ([N])", field)
    return data.reshape(shape)


def parse_forward_backward(raw: bytes, max_tokens: int) -> ForwardBackward:
    """The SDK's protobuf `ForwardBackwardRequest`; at most `max_tokens` input tokens in all."""
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends: the body is bad
        raise RequestError(f"the body is not a ForwardBackwardRequest protobuf: {e}", "body") from None
    if not msg.model_id:
        raise RequestError("model_id is missing", "model_id")
    if not msg.data:
        raise RequestError("data is empty: send at least one Datum", "data")
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data, total = [], 0
    for i, d in enumerate(msg.data):
        parts = []
        for j, chunk in enumerate(d.model_input):
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise RequestError(f"data[{i}].model_input.chunks[{j}]: only token chunks are served (no images, "
                                   "no audio)", f"data[{i}].model_input")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        if not tokens.size:
            raise RequestError(f"data[{i}].model_input is empty", f"data[{i}].model_input")
        total += tokens.size
        if total > max_tokens:
            raise RequestError(f"data: more than {max_tokens} input tokens in one request (--max-tokens-per-request); "
                               "send fewer datums per call", "data")
        inputs = {name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}") for name, t in d.loss_fn_inputs.items()}
        for name, values in inputs.items():
            if values.shape[0] != tokens.size:
                raise RequestError(f"data[{i}].loss_fn_inputs.{name} has {values.shape[0]} values for "
                                   f"{tokens.size} input tokens", f"data[{i}].loss_fn_inputs.{name}")
        data.append(Datum(tokens, inputs))
    return ForwardBackward(msg.model_id, msg.loss_fn, config, data, msg.forward_only)


def forward_backward_output(per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput`: one ArrayRecord, each field float32 with per-datum byte offsets."""
    pb = _pb()
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(per_datum))
    for name in per_datum[0] if per_datum else ():
        arrays = [np.ascontiguousarray(d[name], dtype=np.float32) for d in per_datum]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        record.fields[name].CopyFrom(pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays),
                                                      offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                   metrics=metrics)
    return out.SerializeToString()


@dataclass(frozen=True)
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # a stop string / token / eos, else the length limit


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """`SampleResponse`; `prompt_logprobs` has NaN at position 0 (no context), as the SDK reads it."""
    pb = _pb()
    out = pb.SampleResponse()
    for s in sequences:
        out.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(s.tokens, np.int32).tobytes(),
                          logprobs=np.asarray(s.logprobs, np.float32).tobytes())
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return out.SerializeToString()
