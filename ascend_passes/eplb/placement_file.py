"""Read and write expert placements in the JSON layout serving engines (vllm-ascend) use.

The layout, one entry per MoE layer and per device (EP rank)::

    {"moe_layer_count": L,
     "layer_list": [{"layer_id": i, "device_count": W,
                     "device_list": [{"device_id": r,
                                      "device_expert": [logical id per local slot]}]}]}

Layer numbering: the main model's MoE layers are ``0 .. M-1`` in model order (dense layers are
not counted), and the MTP layers follow as ``M, M+1, ...``; ``moe_layer_count`` counts both.  Row
``i`` of ``phy2log`` is layer ``i``; device ``r``'s list is ``phy2log[i, r*S:(r+1)*S]``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from ascend_passes.eplb.validate import validate_placement
from ascend_passes.errors import ConfigError

__all__ = [
    "MAX_PLACEMENT_FILE_BYTES",
    "export_placement",
    "load_placement",
    "placement_to_json",
    "placement_from_json",
]

# The most bytes load_placement reads.  A DeepSeek-V3 placement (61 layers, 320 devices) is ~1 MiB
# in the exported layout; 64 MiB leaves room for any real model and stops an endless file.
MAX_PLACEMENT_FILE_BYTES = 64 << 20
# Nesting of the documented layout: {layer_list: [{device_list: [{device_expert: [...]}]}]}
_MAX_DEPTH = 6
# a JSON string (skipped whole, escapes included) or one bracket
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def placement_to_json(phy2log: torch.Tensor, num_ranks: int) -> dict[str, Any]:
    """The JSON object for ``phy2log[L, P]`` on ``num_ranks`` devices (P a multiple of it)."""
    layers, slots = phy2log.shape
    if num_ranks < 1 or slots % num_ranks != 0:
        raise ConfigError(
            f"{slots} physical slots per layer do not split evenly over {num_ranks} devices; "
            f"use a multiple of {num_ranks} slots"
        )
    per_device = phy2log.to("cpu", torch.int64).view(layers, num_ranks, slots // num_ranks)
    return {
        "moe_layer_count": layers,
        "layer_list": [
            {
                "layer_id": layer,
                "device_count": num_ranks,
                "device_list": [{"device_id": rank, "device_expert": experts} for rank, experts in enumerate(devices)],
            }
            for layer, devices in enumerate(per_device.tolist())
        ],
    }


def _dumps(record: dict[str, Any]) -> str:
    """JSON text with one line per device: readable, diffable, and still plain JSON."""
    lines = ["{", f'  "moe_layer_count": {record["moe_layer_count"]},', '  "layer_list": [']
    layer_list = record["layer_list"]
    for i, layer in enumerate(layer_list):
        lines.append(
            f'    {{"layer_id": {layer["layer_id"]}, "device_count": {layer["device_count"]}, "device_list": ['
        )
        devices = layer["device_list"]
        for j, device in enumerate(devices):
            comma = "," if j + 1 < len(devices) else ""
            lines.append(f"      {json.dumps(device)}{comma}")
        lines.append("    ]}" + ("," if i + 1 < len(layer_list) else ""))
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def export_placement(phy2log: torch.Tensor, num_ranks: int, path: str | os.PathLike[str]) -> None:
    """Write ``phy2log[L, P]`` to ``path``; rows are main MoE layers first, then MTP layers.

    The file is written to a temporary name and renamed, so a failed write leaves any existing
    file as it was.
    """
    if phy2log.dim() != 2:
        raise ConfigError(f"phy2log must have shape [layers, physical slots], got {tuple(phy2log.shape)}")
    text = _dumps(placement_to_json(phy2log, num_ranks))
    shown, path = path, Path(path)
    if path.is_dir():  # else os.replace fails naming the temporary file
        raise ConfigError(f"export_placement: {shown} is a directory; pass a file path, e.g. {path / 'placement.json'}")
    if not path.parent.is_dir():
        raise ConfigError(
            f"export_placement: cannot write {shown}: its directory {path.parent} does not exist; create it first"
        )
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise ConfigError(f"export_placement: cannot write {shown} ({exc.strerror or type(exc).__name__})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:  # the temporary file never stays behind, nor is it named
        Path(tmp).unlink(missing_ok=True)
        raise ConfigError(f"export_placement: cannot write {shown} ({exc.strerror or type(exc).__name__})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Fail:
    """Builds the ``ConfigError`` of one placement source: ``placement file SOURCE: WHERE problem``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __call__(self, where: str, problem: str) -> ConfigError:
        return ConfigError(f"placement file {self.source}: {where}{problem}")


def _check_header(record: Any, num_layers: int, fail: _Fail) -> list[Any]:
    """The top-level object: its keys and ``moe_layer_count``; returns ``layer_list``."""
    if not isinstance(record, dict):
        raise fail("", f"top level must be a JSON object, got {type(record).__name__}")
    for key in ("moe_layer_count", "layer_list"):
        if key not in record:
            raise fail("", f'missing key "{key}"')
    count, layer_list = record["moe_layer_count"], record["layer_list"]
    if not _int(count):
        raise fail("", f'"moe_layer_count" must be an integer, got {count!r}')
    if not isinstance(layer_list, list):
        raise fail("", '"layer_list" must be a list')
    if count != num_layers:
        raise fail(
            "",
            f"moe_layer_count is {count} but the model has {num_layers} MoE layers (main MoE "
            "layers, then MTP layers); use a placement file made for this model and "
            "speculative config",
        )
    if len(layer_list) != count:
        raise fail("", f"moe_layer_count is {count} but layer_list has {len(layer_list)} entries")
    return layer_list


def _parse_device(
    device: Any,
    where: str,
    seen: dict[int, list[int]],
    slots: int | None,
    *,
    num_logical: int,
    num_ranks: int,
    fail: _Fail,
) -> tuple[int, list[int]]:
    """One ``device_list`` entry: ``(device_id, logical expert per local slot)``.

    ``slots`` is the slot count of the first device in the file (None for the first device).
    """
    if not isinstance(device, dict) or not {"device_id", "device_expert"} <= device.keys():
        raise fail(where, 'each device needs "device_id" and "device_expert"')
    device_id, experts = device["device_id"], device["device_expert"]
    if not _int(device_id) or not 0 <= device_id < num_ranks:
        raise fail(where, f"device_id {device_id!r} is not in [0, {num_ranks})")
    if device_id in seen:
        raise fail(where, f"device_id {device_id} appears twice")
    if not isinstance(experts, list) or not all(_int(e) for e in experts):
        raise fail(where, f"device {device_id}: device_expert must be a list of integers")
    if slots is None:
        slots = len(experts)
    if len(experts) != slots or not experts:
        raise fail(
            where,
            f"device {device_id} has {len(experts)} expert slots but the first device in "
            f"the file has {slots}; every device needs the same number of slots",
        )
    out_of_range = [e for e in experts if not 0 <= e < num_logical]
    if out_of_range:
        raise fail(
            where,
            f"device {device_id} lists logical expert {out_of_range[0]}, outside "
            f"[0, {num_logical}); the model has {num_logical} routed experts",
        )
    return device_id, experts


def _parse_layer(
    layer: Any,
    position: int,
    rows: dict[int, list[int]],
    slots: int | None,
    *,
    num_layers: int,
    num_logical: int,
    num_ranks: int,
    fail: _Fail,
) -> tuple[int, list[int]]:
    """One ``layer_list`` entry: ``(layer_id, its phy2log row)`` with devices in rank order."""
    where = f"layer_list[{position}]: "
    if not isinstance(layer, dict):
        raise fail(where, "each layer must be a JSON object")
    for key in ("layer_id", "device_count", "device_list"):
        if key not in layer:
            raise fail(where, f'missing key "{key}"')
    layer_id = layer["layer_id"]
    if not _int(layer_id) or not 0 <= layer_id < num_layers:
        raise fail(where, f"layer_id {layer_id!r} is not in [0, {num_layers})")
    if layer_id in rows:
        raise fail(where, f"layer_id {layer_id} appears twice")
    where = f"layer {layer_id}: "
    devices = layer["device_list"]
    if not _int(layer["device_count"]) or layer["device_count"] != num_ranks:
        raise fail(
            where,
            f"device_count is {layer['device_count']!r} but EP has {num_ranks} ranks; "
            "use a placement file made for this EP size",
        )
    if not isinstance(devices, list) or len(devices) != num_ranks:
        got = len(devices) if isinstance(devices, list) else type(devices).__name__
        raise fail(where, f"device_list must list {num_ranks} devices, got {got}")
    by_device: dict[int, list[int]] = {}
    for device in devices:
        device_id, experts = _parse_device(
            device, where, by_device, slots, num_logical=num_logical, num_ranks=num_ranks, fail=fail
        )
        slots = len(experts)
        by_device[device_id] = experts
    return layer_id, [e for rank in range(num_ranks) for e in by_device[rank]]


def placement_from_json(
    record: Any, *, num_layers: int, num_logical: int, num_ranks: int, source: str = "placement"
) -> torch.Tensor:
    """Parse and validate a placement JSON object; returns ``phy2log[L, P]`` (int64).

    Three phases: the header (``moe_layer_count``, ``layer_list``), each layer and its devices
    (types, ranges, equal slot counts), then the placement as a whole (``validate_placement``:
    no logical expert lost).  Raises ``ConfigError`` naming ``source``, the layer and device, and
    what is wrong.
    """
    fail = _Fail(source)
    layer_list = _check_header(record, num_layers, fail)
    rows: dict[int, list[int]] = {}
    slots: int | None = None  # every device of every layer has the first device's slot count
    for position, layer in enumerate(layer_list):
        layer_id, row = _parse_layer(
            layer, position, rows, slots, num_layers=num_layers, num_logical=num_logical, num_ranks=num_ranks, fail=fail
        )
        rows[layer_id] = row
        slots = len(row) // num_ranks

    phy2log = torch.tensor([rows[i] for i in range(num_layers)], dtype=torch.int64)
    if num_layers == 0:
        return phy2log.view(0, 0)
    validate_placement(phy2log, num_logical, num_ranks, source=f"placement file {source}")
    return phy2log


def _read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON value in ``path``, read up to ``MAX_PLACEMENT_FILE_BYTES``; ConfigError otherwise."""
    if not isinstance(path, (str, os.PathLike)):  # open(3) would read file descriptor 3
        raise ConfigError(f"placement file {path!r}: must be a path (str or os.PathLike), got {type(path).__name__}")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PLACEMENT_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"placement file {path}: cannot be read ({exc.strerror or exc})") from exc
    if len(data) > MAX_PLACEMENT_FILE_BYTES:
        raise ConfigError(
            f"placement file {path}: more than {MAX_PLACEMENT_FILE_BYTES >> 20} MiB, the most "
            "read of a placement file (a real one is a few KiB per layer); give the path of a "
            "placement JSON file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"placement file {path}: not UTF-8 text (byte {exc.start}); give a placement JSON file"
        ) from exc
    depth = _max_depth(text)
    if depth > _MAX_DEPTH:
        raise ConfigError(
            f"placement file {path}: JSON nested {depth} levels deep; the placement format "
            f"nests {_MAX_DEPTH} (object, layer_list, layer, device_list, device, device_expert)"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"placement file {path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc


def _max_depth(text: str) -> int:
    """The deepest ``[``/``{`` nesting in JSON ``text`` (brackets inside strings do not count),
    found without recursion, so a hostile file cannot exhaust the stack of ``json.loads``."""
    depth = deepest = 0
    for token in _BRACKETS.finditer(text):
        char = token.group()
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def load_placement(path: str | os.PathLike[str], *, num_layers: int, num_logical: int, num_ranks: int) -> torch.Tensor:
    """Read a placement file and return its validated ``phy2log[L, P]``.

    ``num_layers`` counts main MoE layers and MTP layers together (see the module docstring).
    Raises ``ConfigError`` naming the file, the layer and the problem for an unreadable or
    malformed file, a wrong layer or device count, ids out of range, devices with unequal slot
    counts, or a layer that loses a logical expert.  At most ``MAX_PLACEMENT_FILE_BYTES`` are
    read: a larger file (or an endless one such as ``/dev/zero``) is refused, not loaded.
    """
    record = _read_json(path)
    return placement_from_json(
        record,
        num_layers=num_layers,
        num_logical=num_logical,
        num_ranks=num_ranks,
        source=str(path),
    )
