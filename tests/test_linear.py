"""The linear pass: ``mm(x, weight.T)`` / ``addmm(bias, x, weight.T)`` → ``ascend.linear`` on
tiny Hugging Face models (decode and prefill shapes, eager and Inductor downstream), the forms it
leaves alone, and that it runs for target cpu only."""

from __future__ import annotations

import pytest
import torch
from _helpers import rel_diff
from torch import nn

import ascend_passes as ap
from ascend_passes import models
from ascend_passes.config import AscendPassConfig
from ascend_passes.pass_manager import PassContext
from ascend_passes.passes.linear import LinearPass


def _compile(model, inputs, **options):
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend="ascend_passes", options={"compiler": "eager", **options})(*inputs)
    assert len(reports) == 1
    return out, reports[0]


def _linears(model: nn.Module) -> int:
    return sum(isinstance(m, nn.Linear) for m in model.modules())


@pytest.mark.parametrize("batch,tokens", [(8, 1), (1, 24)], ids=["decode", "prefill"])
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_llama_every_linear_becomes_ascend_linear(batch, tokens, compiler):
    model, inputs = models.llama_dense(num_layers=2, batch=batch, tokens=tokens)
    with torch.no_grad():
        ref = model(*inputs)
    out, report = _compile(model, inputs, compiler=compiler)
    # q, k, v, o, gate, up, down per layer, and the lm head
    assert report.count("ascend.linear") == _linears(model) == 2 * 7 + 1
    assert report.count("aten.mm") == 0 and report.count("aten.addmm") == 0
    assert rel_diff(out, ref) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_decode_linears_and_moe(dtype):
    model, inputs = models.deepseek_v3("grouped_mm", num_layers=2, batch=8, tokens=1, dtype=dtype)
    with torch.no_grad():
        ref = model(*inputs)
    out, report = _compile(model, inputs)
    linear = report.passes["linear"]
    assert linear.status == "ok" and report.count("ascend.linear") == len(linear.matches) > 0
    assert report.count("aten.mm") == 0 and report.count("aten.addmm") == 0
    assert report.count("ascend.grouped_matmul") == 2  # the MoE layer's experts stay grouped
    assert rel_diff(out, ref) <= (1e-4 if dtype == torch.float32 else 2e-2)


def test_bias_forms():
    """A biased linear on 2-D input (``addmm``) and on 3-D input (``view → addmm → view``) becomes
    ``ascend.linear`` with the bias; an unbiased one without; a matmul whose second operand is not a
    transpose (``h @ y``) stays an ``mm``."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 12), nn.Linear(12, 8, bias=False), nn.Linear(16, 4)

        def forward(self, x2d, x3d, y):
            return self.b(self.a(x2d)) @ y, self.c(x3d)

    model = Block().eval()
    x2d, x3d, y = torch.randn(5, 16), torch.randn(2, 3, 16), torch.randn(8, 3)
    out, report = _compile(model, (x2d, x3d, y))
    with torch.no_grad():
        for got, want in zip(out, model(x2d, x3d, y)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [m.pattern for m in report.passes["linear"].matches] == ["linear"] * 3
    linears = [n for n in report.graph.graph.nodes if n.target is torch.ops.ascend.linear.default]
    biases = sorted(tuple(n.args[2].meta["val"].shape) for n in linears if len(n.args) > 2 and n.args[2] is not None)
    assert len(linears) == 3 and biases == [(4,), (12,)]
    assert report.count("aten.mm") == 1 and report.count("aten.addmm") == 0  # (…) @ y


def test_addmm_with_a_full_sized_bias_stays_addmm_with_a_near_miss():
    """``addmm`` takes any bias that broadcasts (Inductor's post-grad graphs fold a full-sized add
    into it: seen on Llama 4 through ``inductor_pass``); ``ascend.linear``'s bias is a vector over
    the output features.  Such a match was rewritten, failed the op's argument check and rolled
    the whole linear pass back; now it is a near-miss and the other linears are still rewritten."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 8)
            self.w = nn.Parameter(torch.randn(8, 16))
            self.register_buffer("full_bias", torch.randn(5, 8))

        def forward(self, x):
            return torch.addmm(self.full_bias, x, self.w.t()) + self.proj(x)

    model = Block().eval()
    x = torch.randn(5, 16)
    out, report = _compile(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    linear = report.passes["linear"]
    assert linear.status == "ok" and [m.pattern for m in linear.matches] == ["linear"]
    assert report.count("aten.addmm") == 1 and report.count("ascend.linear") == 1
    assert any(
        "bias of shape (5, 8) is not a vector over the 8 output features" in str(nm) for nm in linear.near_misses
    )


def test_runs_for_target_cpu_only():
    config = AscendPassConfig()
    assert LinearPass(config).enabled(PassContext(config, target="cpu"))
    for target in ("npu", "cuda"):
        assert not LinearPass(config).enabled(PassContext(config, target=target))


def test_disable_keeps_the_matmuls():
    model, inputs = models.llama_dense(num_layers=1)
    with torch.no_grad():
        ref = model(*inputs)
    out, report = _compile(model, inputs, disable="linear")
    assert "linear" not in report.passes
    assert report.count("ascend.linear") == 0 and report.count("aten.mm") == _linears(model)
    assert rel_diff(out, ref) <= 1e-5
