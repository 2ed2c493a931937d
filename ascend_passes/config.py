"""One configuration object for a compile: the pass pipeline, the downstream compiler and the
settings of the distributed / EPLB passes; built from ``torch.compile(options=...)`` with checks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ConfigError
from .passes import PASS_TABLE

log = logging.getLogger("ascend_passes.config")

# The default pipeline: every pass the package has, in order (DESIGN.md, "Passes").
DEFAULT_PIPELINE: tuple[str, ...] = tuple(PASS_TABLE)

TARGETS = ("auto", "cpu", "cuda", "npu")
COMPILERS = ("auto", "eager", "inductor", "torchair", "npugraph_ex")
# eplb.num_redundant_experts above this is refused at config time, before attach() sizes tables
# and weights by it (num_experts + num_redundant physical slots per layer)
MAX_REDUNDANT_EXPERTS = 4096


@dataclass(frozen=True)
class SequenceParallelConfig:
    """Sequence parallelism: ``all_reduce → norm`` becomes ``reduce_scatter → norm → all_gather``.

    ``tp_group`` is a ``torch.distributed`` ProcessGroup or a group name; ``None`` means the
    default (world) group.  It is left out of the hash except for its name and size.
    """

    enabled: bool = False
    tp_group: Any = None


@dataclass(frozen=True)
class EplbConfig:
    """Expert-parallel load balancing: logical→physical expert indirection in every MoE layer."""

    enabled: bool = False
    num_redundant_experts: int = 0
    placement_file: str | None = None
    record_load: bool = True
    ep_size: int = 1
    # expert parallelism across processes: a torch.distributed ProcessGroup or group name; None
    # means the default (world) group.  Left out of the hash except for its name and size.
    ep_group: Any = None
    # the MoE input under expert parallelism: "replicated" (every rank has all tokens: all_reduce
    # of the partial outputs) or "sharded" (each rank its own tokens, e.g. sequence parallel:
    # all_gather → local experts → reduce_scatter)
    ep_tokens: str = "replicated"

    def __post_init__(self) -> None:
        # checked here, not only in AscendPassConfig: attach() takes an EplbConfig directly
        _typed("eplb.num_redundant_experts", self.num_redundant_experts, int)
        if self.num_redundant_experts < 0:
            raise ConfigError(
                f"option 'eplb.num_redundant_experts'={self.num_redundant_experts} is "
                "negative; use 0 or more redundant experts"
            )
        if self.num_redundant_experts > MAX_REDUNDANT_EXPERTS:
            raise ConfigError(
                f"option 'eplb.num_redundant_experts'={self.num_redundant_experts} is more "
                f"than {MAX_REDUNDANT_EXPERTS}: each redundant expert is one more physical slot "
                "holding a full copy of an expert's weights (a few hot experts per EP rank is "
                "typical); use a count of the order of the routed experts"
            )
        if self.placement_file is not None and (
            not isinstance(self.placement_file, (str, os.PathLike)) or not str(self.placement_file).strip()
        ):
            raise ConfigError(
                f"option 'eplb.placement_file'={self.placement_file!r} must be "
                "the path of a placement JSON file (str or os.PathLike), or None"
            )


@dataclass(frozen=True)
class AscendPassConfig:
    """Everything one compile with ``backend="ascend_passes"`` needs to know.

    ``passes`` is the pipeline, in order; the textual form ``"cleanup,norm,moe"`` is accepted.
    ``disable`` removes passes from it.  ``verify`` runs the rewritten graph on the example
    inputs and compares it with the original (``verify_each`` does so after every pass).
    """

    passes: tuple[str, ...] = DEFAULT_PIPELINE
    disable: tuple[str, ...] = ()
    target: str = "auto"
    compiler: str = "auto"
    strict: bool = False
    verify: bool = False
    verify_each: bool = False
    verify_rtol: float = 1e-4
    verify_atol: float = 1e-4
    dump_dir: str | None = None
    # ascend ops handed to Inductor as their ATen decomposition (compiler="inductor" only): on CPU
    # Inductor fuses these pointwise / norm / small-matmul chains with their neighbours, which an
    # opaque call prevents; the rewritten graph (what capture() and the CLI show) keeps them fused.
    # None: every op whose record says it decomposes (rms_norm, add_rms_norm, swiglu, mla_prolog —
    # measured faster than the opaque op with tools/bench_model.py; the MoE routing / grouped
    # matmul and gating ops stay C++ kernels).  Names are checked by ``decompose_ops()``.
    inductor_decompose: tuple[str, ...] | None = None
    sequence_parallel: SequenceParallelConfig = field(default_factory=SequenceParallelConfig)
    shared_expert_dp: bool = False
    eplb: EplbConfig = field(default_factory=EplbConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "passes", _pass_list("passes", self.passes))
        object.__setattr__(self, "disable", _pass_list("disable", self.disable))
        _choice("target", self.target, TARGETS)
        _choice("compiler", self.compiler, COMPILERS)
        for name in ("strict", "verify", "verify_each", "shared_expert_dp"):
            _typed(name, getattr(self, name), bool)
        for name in ("verify_rtol", "verify_atol"):
            value = getattr(self, name)
            _typed(name, value, (int, float))
            if not math.isfinite(value) or value < 0:  # NaN compares false: it would pass any check
                raise ConfigError(f"option '{name}'={value!r} is not a tolerance; use a finite number >= 0 (e.g. 1e-4)")
        if self.dump_dir is not None:
            _typed("dump_dir", self.dump_dir, str)
            if not self.dump_dir.strip():
                raise ConfigError(
                    f"option 'dump_dir'={self.dump_dir!r} names no folder; give a "
                    "folder to write the graphs to, or leave dump_dir unset (None) "
                    "for no dump"
                )
        if self.inductor_decompose is not None:
            names = _names("inductor_decompose", self.inductor_decompose, "ascend op names")
            object.__setattr__(self, "inductor_decompose", tuple(dict.fromkeys(names)))
        _typed("sequence_parallel", self.sequence_parallel, SequenceParallelConfig)
        _typed("eplb", self.eplb, EplbConfig)
        _typed("sequence_parallel.enabled", self.sequence_parallel.enabled, bool)
        if self.shared_expert_dp and not self.sequence_parallel.enabled:
            # shared-expert DP computes on the SP token shards: it cannot run without SP
            log.warning(
                "shared_expert_dp needs sequence parallelism; turning sequence_parallel on "
                "(set sequence_parallel=True to silence this warning)"
            )
            object.__setattr__(self, "sequence_parallel", dataclasses.replace(self.sequence_parallel, enabled=True))
        _typed("eplb.enabled", self.eplb.enabled, bool)
        _typed("eplb.record_load", self.eplb.record_load, bool)
        _typed("eplb.ep_size", self.eplb.ep_size, int)
        if self.eplb.ep_size < 1:
            raise ConfigError(f"option 'eplb.ep_size'={self.eplb.ep_size} must be 1 or more")
        if self.eplb.ep_group is not None and not (
            isinstance(self.eplb.ep_group, str) or hasattr(self.eplb.ep_group, "size")
        ):
            raise ConfigError(
                f"option 'eplb.ep_group'={self.eplb.ep_group!r} must be a "
                "torch.distributed ProcessGroup, a group name or None (the world group)"
            )
        _choice("eplb.ep_tokens", self.eplb.ep_tokens, ("replicated", "sharded"))

    # ----------------------------------------------------------------------------- checks at build
    def check_environment(self) -> None:
        """The checks that need the registered ops or torch.distributed's process groups.  The
        ``PassManager`` runs them when it builds the pipeline; constructing a config never does
        (a config is data: it registers no op and touches no process group)."""
        self.decompose_ops()
        if self.sequence_parallel.enabled:
            from .passes.sequence_parallel import resolve_tp_group

            _known_group("sequence_parallel.tp_group", self.sequence_parallel.tp_group)
            resolve_tp_group(self.sequence_parallel.tp_group)  # ConfigError with the fix
        if self.eplb.ep_size > 1:
            _known_group("eplb.ep_group", self.eplb.ep_group)

    def decompose_ops(self) -> tuple[str, ...]:
        """The ascend ops handed to Inductor as their decomposition (``inductor_decompose``, or
        every op whose record decomposes when it is None); ConfigError for an op without one."""
        from .ops import DECOMPOSABLE_OPS as valid

        if self.inductor_decompose is None:
            return valid
        for item in self.inductor_decompose:
            if item not in valid:
                raise ConfigError(
                    f"option 'inductor_decompose' names {item!r}, which is not an ascend op with a "
                    f"decomposition; valid ops are: {', '.join(valid)}"
                )
        return self.inductor_decompose

    # ----------------------------------------------------------------------------- building
    @classmethod
    def from_options(
        cls, options: AscendPassConfig | Mapping[str, Any] | None = None, **overrides: Any
    ) -> AscendPassConfig:
        """Build a config from ``torch.compile(options=...)``.

        Keys are the field names; sections take a dict (``{"eplb": {"num_redundant_experts": 4}}``)
        or dotted keys (``{"eplb.num_redundant_experts": 4}``).  Unknown keys raise ConfigError
        naming the key and the valid ones.
        """
        if isinstance(options, AscendPassConfig):
            base = options
            options = {}
        else:
            base = cls()
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ConfigError(f"options must be a dict or an AscendPassConfig, got {type(options).__name__}")
        merged: dict[str, Any] = {**options, **overrides}
        top: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {}
        top_names = {f.name for f in fields(cls)}
        for key, value in merged.items():
            if not isinstance(key, str):
                raise ConfigError(f"option names must be strings, got {key!r}")
            head, _, rest = key.partition(".")
            if head not in top_names:
                raise ConfigError(_unknown(key, sorted(top_names)))
            section_cls = _SECTIONS.get(head)
            if rest:
                if section_cls is None:
                    raise ConfigError(f"option '{head}' has no sub-options; got '{key}'")
                sections.setdefault(head, {})[rest] = value
            elif section_cls is not None and isinstance(value, Mapping):
                sections.setdefault(head, {}).update(value)
            elif section_cls is not None and isinstance(value, bool):
                sections.setdefault(head, {})["enabled"] = value
            else:
                top[key] = value
        for head, values in sections.items():
            section_cls = _SECTIONS[head]
            valid = sorted(f.name for f in fields(section_cls))
            for sub in values:
                if sub not in valid:
                    raise ConfigError(_unknown(f"{head}.{sub}", [f"{head}.{v}" for v in valid]))
            current = top.get(head, getattr(base, head))
            if not isinstance(current, section_cls):
                raise ConfigError(f"option '{head}' must be a dict or {section_cls.__name__}")
            top[head] = dataclasses.replace(current, **values)
        return dataclasses.replace(base, **top)

    # ----------------------------------------------------------------------------- derived
    def pipeline(self) -> tuple[str, ...]:
        """The passes that run, in order: ``passes`` minus ``disable``."""
        return tuple(p for p in self.passes if p not in self.disable)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able view; process groups appear by name and size only."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value = {g.name: _jsonable(getattr(value, g.name)) for g in fields(value)}
            else:
                value = _jsonable(value)
            out[f.name] = value
        return out

    def hash(self) -> str:
        """Stable across processes: equal configs give equal hashes."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


_SECTIONS = {"sequence_parallel": SequenceParallelConfig, "eplb": EplbConfig}


def _known_group(name: str, group: Any) -> None:
    """A group given by name must name a process group, checked once ``torch.distributed`` runs
    (before that nothing can be named; the passes then raise their own ConfigError)."""
    import torch.distributed as dist

    if isinstance(group, str) and dist.is_available() and dist.is_initialized():
        from .process_group import resolve_group

        resolve_group(group, f"option '{name}'")


def _unknown(key: str, valid: list[str]) -> str:
    return f"unknown option '{key}'; valid options are: {', '.join(valid)}"


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"option '{name}'={value!r} is not valid; choose one of {', '.join(valid)}")


def _typed(name: str, value: Any, types: Any) -> None:
    if isinstance(value, bool) and types in (int, (int, float)):
        ok = False  # True is an int in Python, never a count or a tolerance here
    else:
        ok = isinstance(value, types)
    if not ok:
        expected = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise ConfigError(f"option '{name}'={value!r} must be of type {expected}")


def _names(name: str, value: Any, what: str) -> list[str]:
    """``"a, b,c"`` or a list/tuple of names, as a list; anything else is a ConfigError."""
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ConfigError(f"option '{name}' must be a comma-separated string or a list of {what}")


def _pass_list(name: str, value: Any) -> tuple[str, ...]:
    """Parse ``"cleanup, norm,moe"`` or a sequence of names; check every name is a known pass."""
    items = _names(name, value, "pass names")
    for item in items:
        if item not in DEFAULT_PIPELINE:
            raise ConfigError(
                f"option '{name}' names unknown pass {item!r}; valid passes are: {', '.join(DEFAULT_PIPELINE)}"
            )
    if len(set(items)) != len(items):
        raise ConfigError(f"option '{name}' lists a pass twice: {', '.join(items)}")
    return tuple(items)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    # a process group: identify it by name and size, never by address
    name = getattr(value, "group_name", None) or type(value).__name__
    size = value.size() if callable(getattr(value, "size", None)) else None
    return {"group": str(name), "size": size}
