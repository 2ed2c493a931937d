"""Weight updates of EPLB-attached models (issue 14, item 3): ``weights.load_weight`` through the logical
names (``...experts.gate_up_proj``, logical expert id) writes every replica of the expert — after a
rebalance too, under expert parallelism on every rank that holds one — and a whole logical tensor is
scattered to every physical slot; an RL-style loop over a compiled target and its MTP drafter (R = 4
redundant experts) gives exactly what the un-attached eager model loaded with the same weights gives.
Also item 10: bad argument types and dtypes are ``WeightLoadError`` with the exact message."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _helpers import rel_diff
from torch import nn

import ascend_passes as ap
from ascend_passes import models, weights
from ascend_passes.eplb.state import attach
from ascend_passes.spawn import run_on_ranks

NUM_EXPERTS = 16
REDUNDANT = 4
EPLB = {"compiler": "eager", "strict": True, "eplb": {"enabled": True}}
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def vllm_style_loader(param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int | None = None) -> None:
    """A serving engine's loader: one expert's slice, or the whole tensor without an expert id."""
    (param.data if expert_id is None else param.data[expert_id]).copy_(loaded_weight)


def _zipf(num_layers: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    share = 1.0 / torch.arange(1, NUM_EXPERTS + 1, dtype=torch.float64) ** 1.2
    return torch.stack([(share[torch.randperm(NUM_EXPERTS, generator=gen)] * 10_000).long() for _ in range(num_layers)])


def _slots_hold_logical(state: Any, eager: nn.Module) -> bool:
    """Every (local) physical slot holds the eager model's weights of its logical expert."""
    for layer in state.layers:
        local = layer.phy2log[state.local_slots]
        for logical, physical in zip(EXPERT_WEIGHTS, layer.weights()):
            if not torch.equal(physical.detach(), eager.get_parameter(f"{layer.name}.{logical}").detach()[local]):
                return False
    return True


def _update(model: nn.Module, eager: nn.Module, state: Any, gen: torch.Generator, *, whole: bool) -> list[int]:
    """New random weights for the replicated experts of every layer and one that is not, loaded into
    ``model`` (logical names) and ``eager`` alike; ``whole``: one weight as a whole logical tensor.
    Returns the replicated experts updated."""
    replicated = []
    for layer in state.layers:
        counts = layer.replica_count.tolist()
        multi = [e for e, c in enumerate(counts) if c > 1]
        single = [e for e, c in enumerate(counts) if c == 1]
        assert multi  # a redundant expert: its replicas must all be updated
        chosen = multi + [single[int(torch.randint(len(single), (1,), generator=gen))]]
        replicated += multi
        for logical in EXPERT_WEIGHTS:
            name = f"{layer.name}.{logical}"
            ref = eager.get_parameter(name)
            scale = ref.detach().std()
            if whole and logical == "down_proj":
                new = scale * torch.randn(ref.shape, generator=gen)
                weights.load_weight(model, name, new)
                weights.load_weight(eager, name, new)
                continue
            for expert in chosen:
                new = scale * torch.randn(ref.shape[1:], generator=gen)
                weights.load_weight(model, name, new, expert)
                weights.load_weight(eager, name, new, expert)
    return replicated


# ----------------------------------------------------------------------------- item 3, one process
def test_rl_updates_reach_every_replica_of_compiled_target_and_drafter() -> None:
    torch._dynamo.reset()
    drafter, inputs = models.deepseek_v3_mtp(1, tokens=16)
    target = drafter.main_model
    eager_target, eager_drafter = copy.deepcopy((target, drafter))
    for eager in (eager_target, eager_drafter):  # the un-attached reference takes the same calls
        for name, param in eager.named_parameters():
            if name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS:
                param.weight_loader = vllm_style_loader
    for name, param in drafter.named_parameters():  # the drafter's slots are written by its own loader
        if name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS:
            param.weight_loader = vllm_style_loader
    target_state = attach(target, {"num_redundant_experts": REDUNDANT}, num_mtp_layers=1)
    drafter_state = attach(drafter, {}, main=target_state)
    assert drafter_state.num_physical == NUM_EXPERTS + REDUNDANT
    assert all(p.weight_loader is vllm_style_loader for n, p in drafter.named_parameters() if "eplb_" in n)

    with torch.no_grad(), ap.capture() as reports:
        compiled_target = torch.compile(target, backend="ascend_passes", options=EPLB)
        compiled_drafter = torch.compile(drafter, backend="ascend_passes", options=EPLB)

        def run() -> list[torch.Tensor]:
            return [compiled_target(*drafter.main_example_inputs), *compiled_drafter(*inputs)]

        def want() -> list[torch.Tensor]:
            return [eager_target(*drafter.main_example_inputs), *eager_drafter(*inputs)]

        first = run()
        assert len(reports) == 2 and all(r.count("ascend.eplb_map") >= 1 for r in reports)
        assert all(rel_diff(g, w) <= 1e-5 for g, w in zip(first, want()))
        previous, gen = first, torch.Generator().manual_seed(7)
        for update in range(4):
            if update == 2:  # a rebalance moves replicas: the next updates follow the new tables
                old = target_state.phy2log
                target_state.rebalance(_zipf(target_state.num_layers, seed=1))
                drafter_state.rebalance(_zipf(drafter_state.num_layers, seed=2))
                assert not torch.equal(target_state.phy2log, old)
            replicated = [
                _update(model, eager, state, gen, whole=update == 1)
                for model, eager, state in (
                    (target, eager_target, target_state),
                    (drafter, eager_drafter, drafter_state),
                )
            ]
            assert all(replicated)
            assert _slots_hold_logical(target_state, eager_target), f"update {update}: a stale replica"
            assert _slots_hold_logical(drafter_state, eager_drafter), f"update {update}: a stale replica"
            got, ref = run(), want()
            for g, w in zip(got, ref):
                assert rel_diff(g, w) <= 1e-5, f"update {update}: compiled differs from eager"
            # the updates did reach both graphs (the drafted logits read the last token only: not checked)
            assert rel_diff(got[0], previous[0]) > 1e-3 and rel_diff(got[2], previous[2]) > 1e-3
            previous = got
        assert len(reports) == 2  # no recompilation


# ----------------------------------------------------------------------------- item 3, bad input
@pytest.fixture(scope="module")
def attached() -> tuple[nn.Module, Any]:
    model, _ = models.deepseek_v3("grouped_mm", num_layers=2)
    return model, attach(model, {"num_redundant_experts": REDUNDANT})


EXPERTS = "lm.model.layers.1.mlp.experts"


def test_physical_name_refuses_one_slot_and_takes_a_whole_physical_tensor(attached: Any) -> None:
    model, state = attached
    physical = model.get_parameter(f"{EXPERTS}.eplb_down_proj")  # [20, 64, 32]
    before = physical.detach().clone()
    with pytest.raises(weights.WeightLoadError) as info:
        weights.load_weight(model, f"{EXPERTS}.eplb_down_proj", torch.ones(64, 32), 0)
    assert str(info.value) == (
        f"'{EXPERTS}.eplb_down_proj' holds the physical slots of EPLB-attached experts (a redundant expert has "
        f"several); load expert weights through the logical name '{EXPERTS}.down_proj' with the logical expert id "
        "(every replica is updated); the old weights are kept"
    )
    assert torch.equal(physical, before)
    whole = torch.randn(physical.shape)
    weights.load_weight(model, f"{EXPERTS}.eplb_down_proj", whole)
    assert torch.equal(physical, whole)
    with torch.no_grad():
        physical.copy_(before)


def test_logical_name_errors_change_nothing(attached: Any) -> None:
    model, state = attached
    layer = state.layers[0]
    gate_up = layer.experts.eplb_gate_up_proj  # [20, 64, 64]
    before = gate_up.detach().clone()
    name = f"{EXPERTS}.gate_up_proj"
    cases = [
        (
            (torch.ones(64, 64), 16),
            f"cannot load a tensor of shape (64, 64) into '{name}': expert_id 16 outside "
            "[0, 16); the old weights are kept",
        ),
        (
            (torch.ones(64, 63), 0),
            f"cannot load a tensor of shape (64, 63) into '{name}': expects one expert's "
            "weight of shape (64, 64), got (64, 63); the old weights are kept",
        ),
        (
            (torch.ones(64, 64), "0"),
            f"cannot load a tensor of shape (64, 64) into '{name}': expert_id must be "
            "an int, got str '0'; the old weights are kept",
        ),
        (
            (torch.ones(20, 64, 64),),
            f"cannot load a tensor of shape (20, 64, 64) into '{name}': expects the "
            "logical shape (16, 64, 64) (or one expert's weight (64, 64) with an expert "
            "id), got (20, 64, 64); the old weights are kept",
        ),
        (
            (torch.ones(64, 64, dtype=torch.int64), 0),
            f"cannot load a torch.int64 tensor into '{name}' (torch.float32): a floating-point parameter takes "
            "floating-point tensors only, a cast would change the values silently; convert the tensor first "
            "(e.g. tensor.to(torch.float32)) if that is meant; the old weights are kept",
        ),
    ]
    for args, message in cases:
        with pytest.raises(weights.WeightLoadError) as info:
            weights.load_weight(model, name, *args)
        assert str(info.value) == message
    assert torch.equal(gate_up, before)


def test_a_loader_failing_on_a_later_replica_leaves_every_replica_as_it_was(attached: Any) -> None:
    model, state = attached
    layer = state.layers[0]
    expert = next(e for e, c in enumerate(layer.replica_count.tolist()) if c > 1)
    slots = layer.log2phy[expert, :2].tolist()
    param = layer.experts.eplb_gate_up_proj
    before = param.detach().clone()
    calls = []

    def flaky(p: nn.Parameter, w: torch.Tensor, expert_id: int) -> None:
        calls.append(expert_id)
        if len(calls) == 2:
            raise RuntimeError("lost the connection to the trainer")
        p.data[expert_id].copy_(w)

    param.weight_loader = flaky
    try:
        with pytest.raises(weights.WeightLoadError, match=r"lost the connection to the trainer; the old weights"):
            weights.load_weight(model, f"{EXPERTS}.gate_up_proj", torch.ones(64, 64), expert)
    finally:
        del param.weight_loader
    assert calls == slots  # the first replica was written, then put back
    assert torch.equal(param, before)


# ----------------------------------------------------------------------------- item 10
def test_bad_argument_types_and_dtypes_are_weight_load_errors() -> None:
    model, _ = models.deepseek_v3("grouped_mm", num_layers=2)
    norm = model.get_parameter("lm.model.norm.weight")  # [64] fp32, the default loader
    experts = model.get_parameter(f"{EXPERTS}.down_proj")  # [16, 64, 32]
    experts.weight_loader = weights.expert_weight_loader
    kept = norm.detach().clone(), experts.detach().clone()
    cases = [
        (
            ("lm.model.norm.weight", torch.ones(64, dtype=torch.int64)),
            "cannot load a torch.int64 tensor into 'lm.model.norm.weight' (torch.float32): a floating-point "
            "parameter takes floating-point tensors only, a cast would change the values silently; convert the "
            "tensor first (e.g. tensor.to(torch.float32)) if that is meant; the old weights are kept",
        ),
        (
            ("lm.model.norm.weight", torch.ones(64, dtype=torch.bool)),
            "cannot load a torch.bool tensor into 'lm.model.norm.weight' (torch.float32): a floating-point "
            "parameter takes floating-point tensors only, a cast would change the values silently; convert the "
            "tensor first (e.g. tensor.to(torch.float32)) if that is meant; the old weights are kept",
        ),
        (
            ("lm.model.norm.weight", torch.ones(64, dtype=torch.complex64)),
            "cannot load a torch.complex64 tensor into 'lm.model.norm.weight' (torch.float32): a floating-point "
            "parameter takes floating-point tensors only, a cast would change the values silently; convert the "
            "tensor first (e.g. tensor.to(torch.float32)) if that is meant; the old weights are kept",
        ),
        (
            ("lm.model.norm.weight", [1.0] * 64),
            "cannot load a list into 'lm.model.norm.weight': loaded_weight must be a torch.Tensor (convert it "
            "with torch.as_tensor); the old weights are kept",
        ),
        (
            (f"{EXPERTS}.down_proj", torch.ones(64, 32), "0"),
            f"cannot load a tensor of shape (64, 32) into '{EXPERTS}.down_proj' (shape (16, 64, 32)): expert_id "
            "must be an int, got str '0'; the old weights are kept",
        ),
        (
            (f"{EXPERTS}.down_proj", torch.ones(64, 32), 1.0),
            f"cannot load a tensor of shape (64, 32) into '{EXPERTS}.down_proj' (shape (16, 64, 32)): expert_id "
            "must be an int, got float 1.0; the old weights are kept",
        ),
        (
            (f"{EXPERTS}.down_proj", torch.ones(32, 64), 0),
            f"cannot load a tensor of shape (32, 64) into '{EXPERTS}.down_proj' (shape (16, 64, 32)): expects one "
            "expert's weight of shape (64, 32), got (32, 64); the old weights are kept",
        ),
        ((0, torch.ones(64)), "load_weight() takes the parameter's name as a str, got int 0"),
    ]
    for args, message in cases:
        with pytest.raises(weights.WeightLoadError) as info:
            weights.load_weight(model, *args)
        assert str(info.value) == message
    with pytest.raises(weights.WeightLoadError) as info:  # by keyword, whatever the loader
        weights.load_weight(model, f"{EXPERTS}.down_proj", torch.ones(64, 32), expert_id=True)
    assert str(info.value) == (
        f"cannot load a tensor of shape (64, 32) into '{EXPERTS}.down_proj' (shape "
        "(16, 64, 32)): expert_id must be an int, got bool True; the old weights are kept"
    )
    for call, what in (
        (lambda: weights.load_weight("model", "x", torch.ones(1)), "load_weight()"),
        (lambda: weights.prepare("model"), "prepare()"),
        (lambda: weights.restore(model, "model"), "restore()"),
    ):
        with pytest.raises(weights.WeightLoadError) as info:
            call()
        assert str(info.value) == (
            f"{what} takes models (torch.nn.Module: a target and its MTP drafter), got str 'model'"
        )
    assert torch.equal(norm, kept[0]) and torch.equal(experts, kept[1])
    # what stays allowed: a floating-point cast (a bf16 checkpoint into fp32 weights), a NumPy / tensor id
    weights.load_weight(model, "lm.model.norm.weight", torch.full((64,), 0.5, dtype=torch.bfloat16))
    assert torch.equal(norm, torch.full((64,), 0.5))
    weights.load_weight(model, f"{EXPERTS}.down_proj", torch.zeros(64, 32), torch.tensor(3))
    assert int(torch.count_nonzero(experts[3])) == 0 and torch.equal(experts[4], kept[1][4])


# ----------------------------------------------------------------------------- item 3, expert parallelism
def _ep_rank(rank: int, world_size: int) -> dict:  # a spawned rank (gloo)
    base, inputs = models.deepseek_v3("grouped_mm", num_layers=2)  # same seed on every rank
    eager = copy.deepcopy(base)
    for name, param in eager.named_parameters():
        if name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS:
            param.weight_loader = vllm_style_loader
    model = copy.deepcopy(base)
    eplb = {"num_redundant_experts": REDUNDANT, "ep_size": world_size}
    state = attach(model, eplb)
    torch._dynamo.reset()
    options = {**EPLB, "eplb": {"enabled": True, **eplb}}
    rounds = []
    gen = torch.Generator().manual_seed(11)  # every rank gets the same updates, as from a trainer's broadcast
    with torch.no_grad(), ap.capture() as reports:
        compiled = torch.compile(model, backend="ascend_passes", options=options)
        previous = compiled(*inputs)
        for update in range(3):
            if update == 2:
                state.rebalance(_zipf(state.num_layers, seed=3))  # collective: replicas move between ranks
            replicated = _update(model, eager, state, gen, whole=update == 1)
            layer = state.layers[0]
            spans = [
                sorted({s // state.slots_per_rank for s in layer.log2phy[e, : int(layer.replica_count[e])].tolist()})
                for e in replicated
            ]
            out = compiled(*inputs)
            rounds.append(
                {
                    "vs_eager": rel_diff(out, eager(*inputs)),
                    "changed": rel_diff(out, previous),
                    "slots_ok": _slots_hold_logical(state, eager),
                    "spans": spans,
                }
            )
            previous = out
    return {
        "rank": rank,
        "rounds": rounds,
        "compiles": len(reports),
        "slots": tuple(layer.experts.eplb_gate_up_proj.shape[0] for layer in state.layers),
    }


def test_expert_parallel_updates_reach_the_replicas_on_every_rank() -> None:
    results = run_on_ranks(_ep_rank, 2, timeout_s=240.0)
    per_rank = (NUM_EXPERTS + REDUNDANT) // 2
    for r in results:
        assert r["slots"] == (per_rank,) and r["compiles"] == 1, r
        for update, one in enumerate(r["rounds"]):
            assert one["slots_ok"], (r["rank"], update)
            assert one["vs_eager"] <= 1e-5 and one["changed"] > 1e-3, (r["rank"], update, one)
    # some updated experts had replicas on both ranks: each rank wrote its own
    assert any(span == [0, 1] for one in results[0]["rounds"] for span in one["spans"])


# ----------------------------------------------------------------------------- thread safety
def _waits_for_a_forward(action: Any) -> tuple[bool, bool]:
    """Run ``action`` in a thread while another thread is inside a forward (holds the forward lock's
    reading side): ``(finished while the forward ran, finished after it)``."""
    import threading

    from ascend_passes.eplb.sync import FORWARD_LOCK

    in_forward, leave_forward, done = threading.Event(), threading.Event(), threading.Event()

    def forward() -> None:
        with FORWARD_LOCK.reading():
            in_forward.set()
            leave_forward.wait(30)

    def act() -> None:
        action()
        done.set()

    reader = threading.Thread(target=forward)
    reader.start()
    assert in_forward.wait(30)
    writer = threading.Thread(target=act)
    writer.start()
    try:
        early = done.wait(0.5)
    finally:
        leave_forward.set()
        reader.join(30)
    writer.join(30)
    return early, done.is_set()


def test_expert_updates_and_layout_changes_wait_for_forwards_in_flight(attached: Any) -> None:
    """Weight updates and layout changes of EPLB expert weights take the lock re-balancing takes
    (eplb/sync.py), on its exclusive side: they wait for a forward in flight in another thread, and
    none starts while they write."""
    from ascend_passes.eplb.sync import FORWARD_LOCK

    model, state = attached
    layer = state.layers[0]
    expert = next(e for e, c in enumerate(layer.replica_count.tolist()) if c > 1)
    slots = layer.log2phy[expert, :2].tolist()
    param = layer.experts.eplb_down_proj
    new = torch.randn(param.shape[1:])
    assert _waits_for_a_forward(lambda: weights.load_weight(model, f"{EXPERTS}.down_proj", new, expert)) == (
        False,
        True,
    )
    assert all(torch.equal(param[s], new) for s in slots)  # landed after the forward, in every replica
    with FORWARD_LOCK.reading(), pytest.raises(ap.ConfigError, match="from inside a forward"):
        weights.load_weight(model, f"{EXPERTS}.down_proj", new, expert)

    param.__dict__[weights.LAYOUT_ATTR] = weights.WeightLayout((1, 2))  # as a compiled graph marks it
    try:
        assert _waits_for_a_forward(lambda: weights.prepare(model, layout="execution")) == (False, True)
        assert param.transpose(1, 2).is_contiguous() and not param.is_contiguous()
        assert _waits_for_a_forward(lambda: weights.restore(model)) == (False, True)
        assert param.is_contiguous()
    finally:
        weights.restore(model)
        del param.__dict__[weights.LAYOUT_ATTR]


def test_updates_racing_a_rebalance_thread_leave_no_stale_replica() -> None:
    """A re-balancing thread (serving engines rebalance in the background) and a weight-update
    thread for a bounded time: afterwards every slot holds its expert's latest weights."""
    import threading
    import time

    from ascend_passes.eplb.sync import FORWARD_LOCK

    model, _ = models.deepseek_v3("grouped_mm", num_layers=2)
    state = attach(model, {"num_redundant_experts": REDUNDANT})
    layer = state.layers[0]
    latest = layer.experts.eplb_down_proj.detach()[layer.log2phy[:, 0]].clone()  # [E, H, I] logical
    stop = time.monotonic() + 2.0
    errors: list[BaseException] = []

    def rebalance() -> None:
        seed = 0
        try:
            while time.monotonic() < stop:
                seed += 1
                state.rebalance(_zipf(1, seed))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=rebalance)
    thread.start()
    physical = layer.experts.eplb_down_proj.detach()

    def stale() -> list[int]:  # between updates, with no rebalance half-done
        with FORWARD_LOCK.writing():
            return [s for s, e in enumerate(layer.phy2log.tolist()) if not torch.equal(physical[s], latest[e])]

    gen, updates, seen = torch.Generator().manual_seed(5), 0, []
    while time.monotonic() < stop:
        expert = int(torch.randint(NUM_EXPERTS, (1,), generator=gen))
        latest[expert] = torch.randn(latest.shape[1:], generator=gen)
        weights.load_weight(model, f"{EXPERTS}.down_proj", latest[expert], expert)
        updates += 1
        seen += stale()
    thread.join(30)
    assert not errors and updates > 50
    assert seen == [] and stale() == [], f"{len(seen)} stale slots seen in {updates} updates"
