"""Node metadata of rewritten graphs: ``copy_location`` (passes/_nodes.py) copies exactly the source
location (``stack_trace``, ``nn_module_stack``, ``source_fn_stack``) and our ``ascend_*`` tags, and
every node a pass inserts keeps them — norm, moe, activation, mla, attention, linear and eplb on
DeepSeek-V3, the MTP tag on the drafter's layers, sequence parallelism and shared-expert DP on a
TP-2 graph (rank 0 of a fake process group, in a subprocess) — so dumps show the model's source
line and later passes read layers off the new nodes."""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd

import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)
from ascend_passes import models
from ascend_passes.backend import run_pipeline
from ascend_passes.config import AscendPassConfig
from ascend_passes.passes._nodes import LOCATION_KEYS, copy_location
from ascend_passes.passes.layers import module_path
from ascend_passes.passes.mtp import MTP_TAG

LOCATION = ("stack_trace", "nn_module_stack")  # what every new node must have


# ------------------------------------------------------------------------------ the helper
def _node(graph: fx.Graph, name: str, **meta) -> fx.Node:
    node = graph.call_function(torch.ops.aten.relu.default, (graph.placeholder(f"x_{name}"),), name=name)
    node.meta.update(meta)
    return node


def test_copy_location_copies_exactly_the_location_and_ascend_tags():
    graph = fx.Graph()
    where = {
        "stack_trace": "File model.py, line 3",
        "nn_module_stack": {"k": ("L['self'].layers.0", object)},
        "source_fn_stack": [("relu", torch.relu)],
        MTP_TAG: 1,
        "ascend_other_tag": "x",
    }
    src = _node(
        graph, "src", **where, val="src value", tensor_meta="tm", from_node=["f"], custom={"c": 1}, eager_input_vals="e"
    )
    assert LOCATION_KEYS == ("stack_trace", "nn_module_stack", "source_fn_stack")

    one = _node(graph, "one", val="own value")
    copy_location(src, one)  # a single node
    assert one.meta == {**where, "val": "own value"}

    many = [_node(graph, f"n{i}", stack_trace="old", nn_module_stack={}) for i in range(2)]
    copy_location(src, many)  # several; what src has replaces what they had
    assert all(n.meta == where for n in many)

    bare = _node(graph, "bare")
    copy_location(_node(graph, "nothing"), bare)  # a source without location gives nothing
    assert bare.meta == {}


# ------------------------------------------------------------------------------ every pass
def _new_nodes_per_pass(model, inputs, options) -> dict[str, list[fx.Node]]:
    """Compile with the pipeline (strict) and return, per pass, the call_function nodes it added."""
    cfg = AscendPassConfig.from_options(options, strict=True)
    before: dict[str, set[str]] = {}
    added: dict[str, list[fx.Node]] = {}

    def hook(name, stage, gm, result):
        if stage == "before":
            before[name] = {n.name for n in gm.graph.nodes}
        else:
            added[name] = [n for n in gm.graph.nodes if n.op == "call_function" and n.name not in before[name]]

    def inference(gm, example_inputs):
        unchanged = copy.deepcopy(gm)  # runs the model; the rewritten graph is what we inspect
        run_pipeline(cfg, gm, example_inputs, compiler="eager", hooks=[hook])
        return unchanged

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=inference, inference_compiler=inference))(*inputs)
    return added


def _missing(added: dict[str, list[fx.Node]]) -> dict[str, list[str]]:
    return {p: [n.name for n in nodes if any(k not in n.meta for k in LOCATION)] for p, nodes in added.items()}


def test_every_pass_keeps_the_location_of_what_it_replaced():
    from ascend_passes.eplb.state import attach

    model, inputs = models.deepseek_v3("grouped_mm", num_layers=2)
    attach(model, {"num_redundant_experts": 2})
    added = _new_nodes_per_pass(model, inputs, {"eplb": {"enabled": True}})
    for name in ("norm", "moe", "activation", "mla", "attention", "linear", "eplb"):
        assert added.get(name), f"{name} added no nodes: nothing checked"
    assert _missing(added) == {p: [] for p in added}
    # the model's source line, not the pattern's or the pass's
    assert all("modeling_" in n.meta["stack_trace"] for nodes in added.values() for n in nodes)


def test_mtp_layer_tag_stays_on_the_replacements():
    model, inputs = models.deepseek_v3_mtp(1)
    added = _new_nodes_per_pass(model, inputs, {})
    assert _missing(added) == {p: [] for p in added}
    tagged = [n for nodes in added.values() for n in nodes if MTP_TAG in n.meta]
    assert len(tagged) > 50 and {n.meta[MTP_TAG] for n in tagged} == {0}
    # a new node is tagged exactly when it sits inside the MTP layer's module (not the shared head)
    paths = [module_path(n).split(".") for n in tagged]
    layer = ".".join(p[0] for p in itertools.takewhile(lambda p: len(set(p)) == 1, zip(*paths)))  # their module
    assert layer.startswith("mtp.layers"), layer
    for nodes in added.values():
        for n in nodes:
            inside = f"{module_path(n)}.".startswith(f"{layer}.")
            assert (MTP_TAG in n.meta) == inside, n.format_node()


_SP_SCRIPT = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    import ascend_passes
    from ascend_passes import models_tp
    torch._dynamo.reset()
    model, _ = models_tp.deepseek_v3_tp(0, 2, num_layers=2, shared_expert="replicated")
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    added, before = {}, {}
    def hook(name, stage, gm, result):
        if stage == "before":
            before[name] = {n.name for n in gm.graph.nodes}
        else:
            added[name] = [n for n in gm.graph.nodes if n.op == "call_function" and n.name not in before[name]]
    backend = ascend_passes.make_backend({"compiler": "eager", "sequence_parallel": True,
                                          "shared_expert_dp": True, "strict": True}, hooks=[hook])
    with torch.no_grad():
        torch.compile(model, backend=backend)(ids)
    print(json.dumps({p: [len(nodes), [n.name for n in nodes
                                       if "stack_trace" not in n.meta or "nn_module_stack" not in n.meta]]
                      for p, nodes in added.items()}))
""")


def test_sequence_parallel_and_shared_expert_dp_keep_the_location():
    proc = subprocess.run(
        [sys.executable, "-c", _SP_SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    added = json.loads(proc.stdout.strip().splitlines()[-1])
    assert added["sequence_parallel"][0] > 10 and added["shared_expert_dp"][0] > 0
    assert {p: missing for p, (_, missing) in added.items()} == {p: [] for p in added}
