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
import tempfile
from pathlib import Path
from typing import Any

import torch

from ascend_passes.errors import ConfigError
from ascend_passes.eplb.validate import validate_placement

__all__ = ["export_placement", "load_placement", "placement_to_json", "placement_from_json"]


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
                "device_list": [
                    {"device_id": rank, "device_expert": experts}
                    for rank, experts in enumerate(devices)
                ],
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
            f'    {{"layer_id": {layer["layer_id"]}, "device_count": {layer["device_count"]}, '
            '"device_list": ['
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
        raise ConfigError(
            f"phy2log must have shape [layers, physical slots], got {tuple(phy2log.shape)}"
        )
    text = _dumps(placement_to_json(phy2log, num_ranks))
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def placement_from_json(
    record: Any, *, num_layers: int, num_logical: int, num_ranks: int, source: str = "placement"
) -> torch.Tensor:
    """Parse and validate a placement JSON object; returns ``phy2log[L, P]`` (int64).

    Raises ``ConfigError`` naming ``source``, the layer and device, and what is wrong.
    """

    def fail(where: str, problem: str) -> ConfigError:
        return ConfigError(f"placement file {source}: {where}{problem}")

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

    rows: dict[int, list[int]] = {}
    slots_per_device: int | None = None
    for position, layer in enumerate(layer_list):
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
        if layer["device_count"] != num_ranks:
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
            if not isinstance(device, dict) or not {"device_id", "device_expert"} <= device.keys():
                raise fail(where, 'each device needs "device_id" and "device_expert"')
            device_id, experts = device["device_id"], device["device_expert"]
            if not _int(device_id) or not 0 <= device_id < num_ranks:
                raise fail(where, f"device_id {device_id!r} is not in [0, {num_ranks})")
            if device_id in by_device:
                raise fail(where, f"device_id {device_id} appears twice")
            if not isinstance(experts, list) or not all(_int(e) for e in experts):
                raise fail(where, f"device {device_id}: device_expert must be a list of integers")
            if slots_per_device is None:
                slots_per_device = len(experts)
            if len(experts) != slots_per_device or not experts:
                raise fail(
                    where,
                    f"device {device_id} has {len(experts)} expert slots but the first device in "
                    f"the file has {slots_per_device}; every device needs the same number of "
                    "slots",
                )
            out_of_range = [e for e in experts if not 0 <= e < num_logical]
            if out_of_range:
                raise fail(
                    where,
                    f"device {device_id} lists logical expert {out_of_range[0]}, outside "
                    f"[0, {num_logical}); the model has {num_logical} routed experts",
                )
            by_device[device_id] = experts
        rows[layer_id] = [e for rank in range(num_ranks) for e in by_device[rank]]

    phy2log = torch.tensor([rows[i] for i in range(num_layers)], dtype=torch.int64)
    if num_layers == 0:
        return phy2log.view(0, 0)
    validate_placement(phy2log, num_logical, num_ranks, source=f"placement file {source}")
    return phy2log


def load_placement(
    path: str | os.PathLike[str], *, num_layers: int, num_logical: int, num_ranks: int
) -> torch.Tensor:
    """Read a placement file and return its validated ``phy2log[L, P]``.

    ``num_layers`` counts main MoE layers and MTP layers together (see the module docstring).
    Raises ``ConfigError`` naming the file, the layer and the problem for an unreadable or
    malformed file, a wrong layer or device count, ids out of range, devices with unequal slot
    counts, or a layer that loses a logical expert.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"placement file {path}: cannot be read ({exc.strerror or exc})") from exc
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"placement file {path}: not valid JSON ({exc.msg} at line {exc.lineno} "
            f"column {exc.colno})"
        ) from exc
    return placement_from_json(
        record,
        num_layers=num_layers,
        num_logical=num_logical,
        num_ranks=num_ranks,
        source=str(path),
    )
