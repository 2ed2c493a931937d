"""Issue 14 item 9 (config parts): options that used to be accepted and fail later, or fail with a
torch/pathlib traceback, are a ConfigError at config time with one message that says what to change."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

import ascend_passes as ap
from ascend_passes.config import MAX_REDUNDANT_EXPERTS, EplbConfig
from ascend_passes.eplb.state import attach
from ascend_passes.spawn import run_on_ranks


@pytest.mark.parametrize("name", ["verify_rtol", "verify_atol"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1e-3])
def test_tolerance_must_be_finite_and_not_negative(name, value):
    message = f"option '{name}'={value!r} is not a tolerance; use a finite number >= 0 (e.g. 1e-4)"
    with pytest.raises(ap.ConfigError, match=f"^{re.escape(message)}$"):
        ap.AscendPassConfig.from_options({name: value, "verify": True})


def test_tolerance_zero_and_ints_are_accepted():
    config = ap.AscendPassConfig.from_options({"verify_rtol": 0, "verify_atol": 0.0})
    assert (config.verify_rtol, config.verify_atol) == (0, 0.0)


@pytest.mark.parametrize("value", [123, "", "  ", True])
def test_placement_file_must_be_a_path_at_config_time(value):
    message = (
        f"option 'eplb.placement_file'={value!r} must be the path of a placement JSON file "
        "(str or os.PathLike), or None"
    )
    with pytest.raises(ap.ConfigError, match=f"^{re.escape(message)}$"):
        ap.AscendPassConfig.from_options({"eplb.placement_file": value})
    # attach() takes an EplbConfig directly: the same check, no pathlib TypeError later
    with pytest.raises(ap.ConfigError, match=f"^{re.escape(message)}$"):
        EplbConfig(enabled=True, placement_file=value)


def test_placement_file_path_object_is_accepted(tmp_path):
    config = ap.AscendPassConfig.from_options({"eplb.placement_file": tmp_path / "p.json"})
    assert config.eplb.placement_file == Path(tmp_path / "p.json")


def test_num_redundant_experts_is_bounded_before_attach():
    message = (
        f"option 'eplb.num_redundant_experts'=1000000000000 is more than {MAX_REDUNDANT_EXPERTS}: "
        "each redundant expert is one more physical slot holding a full copy of an expert's "
        "weights (a few hot experts per EP rank is typical); use a count of the order of the "
        "routed experts"
    )
    with pytest.raises(ap.ConfigError, match=f"^{re.escape(message)}$"):
        ap.AscendPassConfig.from_options({"eplb": {"enabled": True, "num_redundant_experts": 10**12}})
    with pytest.raises(ap.ConfigError, match=re.escape(f"is more than {MAX_REDUNDANT_EXPERTS}")):
        attach(_tiny_moe(), {"num_redundant_experts": MAX_REDUNDANT_EXPERTS + 1})
    assert (
        ap.AscendPassConfig.from_options(
            {"eplb.num_redundant_experts": MAX_REDUNDANT_EXPERTS}
        ).eplb.num_redundant_experts
        == 4096
    )


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_dump_dir_is_refused(value):
    message = (
        f"option 'dump_dir'={value!r} names no folder; give a folder to write the graphs "
        "to, or leave dump_dir unset (None) for no dump"
    )
    with pytest.raises(ap.ConfigError, match=f"^{re.escape(message)}$"):
        ap.AscendPassConfig.from_options({"dump_dir": value})


def _unknown_group_names(rank: int, world_size: int) -> list[str]:  # a spawned rank
    messages = []
    for options in (
        {"sequence_parallel": {"enabled": True, "tp_group": "nope"}},
        {"eplb": {"enabled": True, "ep_size": 2, "ep_group": "nope"}},
    ):
        try:
            ap.PassManager(ap.AscendPassConfig.from_options(options))  # the group is checked at build
            messages.append("accepted")
        except ap.ConfigError as exc:
            messages.append(str(exc))
    from ascend_passes.process_group import resolve_group

    for group in ("nope", 7):  # what the passes and attach() resolve, without an option name
        try:
            resolve_group(group)
            messages.append("accepted")
        except ap.ConfigError as exc:
            messages.append(str(exc))
    return messages


def test_unknown_group_name_is_a_config_error_naming_the_group():
    hint = (
        "is not the name of a torch.distributed process group; the world group is named '0'; "
        "pass the ProcessGroup object (e.g. from torch.distributed.new_group), its group_name, "
        "or None for the world group"
    )
    assert run_on_ranks(_unknown_group_names, 1, timeout_s=120)[0] == [
        f"option 'sequence_parallel.tp_group'='nope' {hint}",
        f"option 'eplb.ep_group'='nope' {hint}",
        f"group='nope' {hint}",
        "group=7 is not a torch.distributed ProcessGroup; pass a ProcessGroup, its group_name, "
        "or None for the world group",
    ]


def _tiny_moe():
    from ascend_passes import models

    model, _ = models.BUNDLED["qwen3_moe_grouped_mm"]()
    return model
