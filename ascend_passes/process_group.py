"""The one way the package turns a configured process group into a ``ProcessGroup``."""

from __future__ import annotations

from typing import Any


def resolve_group(group: Any) -> Any:
    """A ``ProcessGroup`` from a group, a group name, or None (the world group)."""
    import torch.distributed as dist

    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    return group
