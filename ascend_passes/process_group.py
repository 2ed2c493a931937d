"""The one way the package turns a configured process group into a ``ProcessGroup``."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError


def resolve_group(group: Any, option: str = "group") -> Any:
    """A ``ProcessGroup`` from a group, a group name, or None (the world group).

    ``option`` names the setting the group came from (``"option 'eplb.ep_group'"``) in the
    ``ConfigError`` raised for a name torch.distributed does not know or a value of another kind.
    """
    import torch.distributed as dist

    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            return _resolve_process_group(group)
        except RuntimeError as exc:  # torch: "Could not resolve the process group registered ..."
            world = dist.group.WORLD
            known = f"; the world group is named {world.group_name!r}" if world is not None else ""
            raise ConfigError(
                f"{option}={group!r} is not the name of a torch.distributed process group{known}; "
                "pass the ProcessGroup object (e.g. from torch.distributed.new_group), its "
                "group_name, or None for the world group"
            ) from exc
    if not callable(getattr(group, "size", None)):
        raise ConfigError(
            f"{option}={group!r} is not a torch.distributed ProcessGroup; pass a ProcessGroup, "
            "its group_name, or None for the world group"
        )
    return group
