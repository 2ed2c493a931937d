"""Every compiled graph gets a distinct, meaningful report id, and ``dump_dir`` folders never overwrite
each other (issue 17: under torch's ahead-of-time compile — vLLM's default — the id was ``"?"``;
pieces of one graph reported alike and dumped into one folder)."""

from __future__ import annotations

from pathlib import Path

import torch

import ascend_passes as ap
from ascend_passes.report import graph_id


class _Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(v + 1e-6)) * self.weight


_FAST_INDUCTOR = {"compiler": "inductor", "passes": "cleanup,norm"}


def _dump_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_aot_compile_report_has_an_id() -> None:
    """torch's ahead-of-time compile has no Dynamo compile context: the id is AOTAutograd's graph
    name (was ``"?"`` for every graph)."""
    model, x = _Norm(), torch.randn(4, 16)
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(enable_aot_compile=True), ap.capture() as reports:
        compiled = torch.compile(model.forward, backend="ascend_passes", fullgraph=True, options=_FAST_INDUCTOR)
        compiled.aot_compile(((x,), {}))
    assert len(reports) == 1 and reports[0].count("ascend.rms_norm") == 1, reports
    assert reports[0].graph_id.startswith("aot:") and reports[0].graph_id.endswith("_inference"), reports[0].graph_id


def test_dump_dir_folders_are_distinct(tmp_path: Path) -> None:
    """Two compiles that want one id (a Dynamo reset restarts its compile ids; an engine naming two
    pieces alike) report distinct ids and dump into distinct folders, named after the ids."""
    model, x = _Norm(), torch.randn(4, 16)
    ids = []
    with torch.no_grad():
        for name in (None, None, "engine.piece0", "engine.piece0"):
            torch._dynamo.reset()
            with ap.capture() as reports:
                compiled = torch.compile(
                    model, backend="ascend_passes", options={"passes": "cleanup,norm", "dump_dir": str(tmp_path)}
                )
                if name is None:
                    out = compiled(x)
                else:
                    with graph_id(name):
                        out = compiled(x)
            torch.testing.assert_close(out, model(x))
            assert len(reports) == 1, reports
            ids.append(reports[0].graph_id)
    assert len(set(ids)) == 4, ids
    # the process may have used "0/0" before (other tests in this worker): the repeat is "0/0#<n>"
    assert ids[0].split("#")[0] == ids[1].split("#")[0] == "0/0" and "#" in ids[1], ids
    assert ids[2].startswith("engine.piece0") and ids[3].startswith("engine.piece0#"), ids
    folders = _dump_folders(tmp_path)
    assert len(folders) == 4, folders
    for folder in folders:  # each folder holds a whole pipeline dump of its own
        assert (tmp_path / folder / "summary.txt").read_text().count("norm") >= 1, folder
