"""The mtp pass: MTP layers of the DeepseekV3 drafter found by structure and tagged, every rewrite
inside them reported under "mtp.N"; look-alikes untagged; target and drafters compiled in one
process with different shapes, all correct."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ascend_passes as ap
from ascend_passes import models
from ascend_passes.config import AscendPassConfig
from ascend_passes.inspect.layers import layer_summary, mtp_layers, ops_by_layer
from ascend_passes.pass_manager import PassContext
from ascend_passes.passes.mtp import MTP_TAG, MtpPass


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _outputs(x):
    return x if isinstance(x, (tuple, list)) else (x,)


@pytest.fixture(scope="module")
def one_process():
    """Target model (prefill, 16 tokens), drafter with 1 MTP layer (8 tokens) and drafter with 2
    MTP layers (12 tokens), compiled one after the other without resetting Dynamo."""
    drafter1, inputs1 = models.deepseek_v3_mtp(1, tokens=8)
    drafter2, inputs2 = models.deepseek_v3_mtp(2, tokens=12, seed=1)
    main, main_inputs = drafter1.main_model, drafter1.main_example_inputs
    torch._dynamo.reset()
    runs = {}
    for name, model, inputs in (("main", main, main_inputs), ("mtp1", drafter1, inputs1), ("mtp2", drafter2, inputs2)):
        with torch.no_grad():
            ref = model(*inputs)
        with torch.no_grad(), ap.capture() as reports:
            out = torch.compile(model, backend="ascend_passes", options={"compiler": "eager"})(*inputs)
        runs[name] = (ref, out, reports)
    return runs


def test_outputs_equal_eager_in_one_process(one_process):
    for name, (ref, out, reports) in one_process.items():
        assert len(reports) == 1, name
        for o, r in zip(_outputs(out), _outputs(ref)):
            assert _rel_diff(o, r) <= 1e-4, name


def test_main_model_has_no_mtp_layers(one_process):
    (report,) = one_process["main"][2]
    assert report.facts["mtp_layers"] == []
    assert not any(MTP_TAG in n.meta for n in report.graph.graph.nodes)
    assert report.count("ascend.mla_prolog") == 2 and report.count("ascend.moe_init_routing_v2") == 1
    assert all(layer.startswith("model.layers.") or layer == "<outside layers>" for layer in layer_summary(report))


@pytest.mark.parametrize("name,num_mtp", [("mtp1", 1), ("mtp2", 2)])
def test_every_mtp_layer_found_and_fully_rewritten(one_process, name, num_mtp):
    (report,) = one_process[name][2]
    facts = report.facts["mtp_layers"]
    assert [f["index"] for f in facts] == list(range(num_mtp))
    assert all(f["nodes"] > 100 and f["eh_proj"] for f in facts)
    expected = [f"mtp.{i}" for i in range(num_mtp)]
    assert mtp_layers(report) == expected
    summary = layer_summary(report)
    per_layer_ops = ops_by_layer(report)
    for layer in expected:
        # the report names the layer, and every rewrite family happened inside it
        matches = summary[layer]
        assert matches["mtp_layer"] == 1
        assert matches["deepseek_router"] == 1 and matches["grouped_mm_experts"] == 1
        assert matches["mla_prolog[q_lora,interleave]"] == 1
        assert matches["rms_norm"] + matches.get("add_rms_norm", 0) >= 5  # enorm, hnorm, q, kv, ...
        ops = per_layer_ops[layer]
        assert ops["ascend.moe_init_routing_v2"] == 1 and ops["ascend.moe_finalize_routing"] == 1
        assert ops["ascend.mla_prolog"] == 1 and ops["ascend.grouped_matmul"] == 2
    # nothing left behind: no inline RMSNorm, no unfused MoE, no near-misses anywhere
    graph = report.graph.graph
    assert not graph.find_nodes(op="call_function", target=torch.ops.aten.rsqrt.default)
    assert not graph.find_nodes(op="call_function", target=torch.ops.aten.histc.default)
    for result in report.passes.values():
        assert result.status == "ok" and result.near_misses == [], result.name
    # the fused MLA ops carry the tag themselves
    tagged = [
        n.meta.get(MTP_TAG) for n in graph.find_nodes(op="call_function", target=torch.ops.ascend.mla_prolog.default)
    ]
    assert tagged == list(range(num_mtp))


def test_mtp_runs_before_the_rewrites():
    names = AscendPassConfig().pipeline()
    assert names[0] == "cleanup"
    # between cleanup and mtp only diagnostics that rewrite nothing (vllm_opaque) may run
    assert set(names[1 : names.index("mtp")]) <= {"vllm_opaque"}
    assert all(names.index("mtp") < names.index(p) for p in ("norm", "moe", "activation", "mla", "attention"))
    assert names.index("mla") > names.index("activation") > names.index("moe")


# ------------------------------------------------------------------------------ structure only
class _RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _LooksLikeMtp(nn.Module):
    """enorm(embedding) ‖ hnorm(hidden), but no eh_proj into a decoder block: ``head`` maps the
    concat straight to the vocabulary (``to_hidden``: back to H but nothing after it)."""

    def __init__(self, to_hidden: bool, vocab: int = 32, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.enorm, self.hnorm = _RMSNorm(hidden), _RMSNorm(hidden)
        self.head = nn.Linear(2 * hidden, hidden if to_hidden else vocab, bias=False)

    def forward(self, ids, previous_hidden):
        x = torch.cat([self.enorm(self.embed(ids)), self.hnorm(previous_hidden)], dim=-1)
        return self.head(x)


@pytest.mark.parametrize("to_hidden", [False, True])
def test_look_alike_is_not_tagged(to_hidden):
    torch.manual_seed(0)
    model = _LooksLikeMtp(to_hidden).eval()
    inputs = (torch.randint(0, 32, (1, 8)), torch.randn(1, 8, 16))
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend="ascend_passes", options={"compiler": "eager"})(*inputs)
        ref = model(*inputs)
    (report,) = reports
    assert report.facts["mtp_layers"] == []
    assert not any(MTP_TAG in n.meta for n in report.graph.graph.nodes)
    mtp = report.passes["mtp"]
    assert mtp.matches == [] and len(mtp.near_misses) == 1
    assert "not tagged" in mtp.near_misses[0].reason
    assert _rel_diff(out, ref) <= 1e-5


def test_extent_from_data_flow_without_module_metadata():
    """A graph without nn_module_stack: the layer's extent comes from data flow and still covers
    the projection, the attention, the MoE and the post-norm of that layer."""
    drafter, inputs = models.deepseek_v3_mtp(2, tokens=8)
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        torch.compile(drafter, backend="ascend_passes", options={"compiler": "eager", "passes": "cleanup,mtp"})(*inputs)
    with_meta = reports[0].graph
    bare = copy.deepcopy(with_meta)
    for node in bare.graph.nodes:
        node.meta.pop("nn_module_stack", None)
        node.meta.pop(MTP_TAG, None)
    ctx = PassContext(AscendPassConfig())
    result = MtpPass(AscendPassConfig()).run(bare, ctx)
    assert [f["extent"] for f in ctx.facts["mtp_layers"]] == ["dataflow", "dataflow"]
    assert len(result.matches) == 2
    for index in (0, 1):
        by_module = {n.name for n in with_meta.graph.nodes if n.meta.get(MTP_TAG) == index}
        by_flow = {n.name for n in bare.graph.nodes if n.meta.get(MTP_TAG) == index}
        assert by_flow == by_module
