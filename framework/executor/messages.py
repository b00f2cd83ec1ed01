"""The driver's commands to the other ranks, as typed msgpack (msgspec), never pickle.

Decoding checks the bytes against the declared types (`Command`, `SchedulerOutput` and the dataclasses it
holds), so whoever reaches the command port can send only data: a payload that is not a valid command is
refused with `CommandDecodeError` and nothing in it runs. Tensors (an encoder request's features) travel as
dtype name, shape and raw bytes; only the dtypes in `WIRE_DTYPES` decode.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec
import torch

from framework.params.scheduler_output import SchedulerOutput

CommandKind = Literal["step", "kv_blocks", "init_kv", "graphs", "shutdown"]

# The payload type each kind must carry (None: no payload).
_PAYLOAD_TYPES: dict[str, Optional[type]] = {
    "step": SchedulerOutput,
    "kv_blocks": None,
    "init_kv": int,
    "graphs": None,
    "shutdown": None,
}

WIRE_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)
}


class CommandDecodeError(ValueError):
    """The bytes are not a valid command (a damaged or crafted payload)."""


class Command(msgspec.Struct, frozen=True):
    """One call the driver makes on its runner, repeated by every worker."""

    kind: CommandKind
    payload: Union[SchedulerOutput, int, None] = None  # SchedulerOutput for "step", the block count for "init_kv"

    def __post_init__(self) -> None:
        want = _PAYLOAD_TYPES[self.kind]
        ok = (
            self.payload is None
            if want is None
            else (isinstance(self.payload, want) and not isinstance(self.payload, bool))
        )
        if not ok:
            raise ValueError(
                f"command {self.kind!r} carries {type(self.payload).__name__}, expected "
                f"{'nothing' if want is None else want.__name__}"
            )


class _WireTensor(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]
    data: bytes


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        flat = obj.detach().to("cpu").contiguous().reshape(-1)
        name = str(flat.dtype).removeprefix("torch.")
        if name not in WIRE_DTYPES:
            raise TypeError(f"a command cannot carry a {name} tensor (allowed: {', '.join(WIRE_DTYPES)})")
        return _WireTensor(name, list(obj.shape), flat.view(torch.uint8).numpy().tobytes())
    raise TypeError(f"a command cannot carry a {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is torch.Tensor:
        wire = msgspec.convert(obj, _WireTensor)
        dtype = WIRE_DTYPES.get(wire.dtype)
        if dtype is None:
            raise ValueError(f"tensor dtype {wire.dtype!r} is not allowed")
        numel = 1
        for size in wire.shape:
            if size < 0:
                raise ValueError(f"negative tensor size in shape {wire.shape}")
            numel *= size
        if numel * dtype.itemsize != len(wire.data):
            raise ValueError(
                f"tensor of shape {wire.shape} and {wire.dtype} needs {numel * dtype.itemsize} bytes, "
                f"got {len(wire.data)}"
            )
        # frombuffer refuses an empty buffer; bytearray: a writable copy the tensor owns
        raw = torch.frombuffer(bytearray(wire.data), dtype=torch.uint8) if wire.data else torch.zeros(0).byte()
        return raw.view(dtype).reshape(wire.shape)
    raise NotImplementedError(f"cannot decode {kind}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(Command, dec_hook=_dec_hook)


def encode_command(command: Command) -> bytes:
    """msgpack bytes of `command` (raises TypeError for anything but plain data and allowed tensors)."""
    return _ENCODER.encode(command)


def decode_command(data: bytes) -> Command:
    """The command in `data`, checked against the declared types; `CommandDecodeError` if it is not one."""
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as err:
        raise CommandDecodeError(f"not a valid driver command ({len(data)} bytes): {err}") from None
