"""Fuzz test of the ascend ops (issue 14): seeded random shapes (empty ones included), dtypes, expert
ids, group lists, NaN / Inf values and bad arguments.

Every op with a C++ kernel is called twice, ``torch.ops.ascend_kernels.<op>`` and
``ascend_passes.ops.reference.<op>``: both must return the same result (integers exactly, floats
within the dtype's tolerance with NaN and +-Inf at the same places) or both raise the same exception
type (for our ``ValueError``, the same message).  The ops without a kernel (``mla_prolog``,
``eplb_*``) run their reference against their fake implementation: the same output shapes and dtypes,
or the same error.  Any other exception is a failure.

The cases run in a child process that caps its own address space (``resource.setrlimit``), so a
runaway allocation (issue 14: a 23 GB one took the machine) fails this test instead of the machine.
``python tests/test_fuzz_ops.py [seed] [scale]`` runs the fuzzer directly (uncapped).
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback

import torch

NAN, INF = float("nan"), float("inf")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# rtol and atol (times the largest finite |reference|) of a float output, by dtype
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
SEED = 20241
# cases per op at scale 1 (the test's run); each op gets bad arguments in ~10-20% of its cases
CASES = {
    "rms_norm": 150,
    "add_rms_norm": 120,
    "swiglu": 120,
    "clipped_swiglu": 120,
    "linear": 120,
    "moe_gating_top_k_softmax": 150,
    "moe_gating_top_k": 200,
    "moe_init_routing_v2": 250,
    "grouped_matmul": 200,
    "moe_finalize_routing": 150,
    "mla_prolog": 40,
    "eplb_map": 60,
    "eplb_record_load": 60,
    "eplb_logical_weight": 40,
    "attention": 150,
}
MEMORY_CAP = 4 << 30


# ------------------------------------------------------------------------------------ inputs
class Gen:
    """Random choices (``random.Random``) and tensors (``torch.Generator``) from one seed."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)

    def pick(self, *options):
        return self.r.choice(options)

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def dtype(self) -> torch.dtype:
        return self.pick(*DTYPES)

    def other_dtype(self, dtype: torch.dtype, p: float = 0.05) -> torch.dtype:
        """``dtype``, or rarely a different (possibly non-float) one: a bad argument."""
        return self.pick(torch.float64, torch.int32, *DTYPES) if self.chance(p) else dtype

    def floats(self, shape, dtype: torch.dtype, grid: float = 0.0) -> torch.Tensor:
        """randn values (on a ``1/grid`` grid when given: ties exact, distinct values far apart),
        sometimes with NaN / +-Inf / 0 sprinkled in; rarely non-contiguous."""
        t = torch.randn(shape, generator=self.g) * self.pick(1.0, 1.0, 4.0, 0.01)
        if grid:
            t = (t * grid).round() / grid
        p = self.pick(0.0, 0.0, 0.0, 0.02, 0.3)
        if p and t.numel():
            mask = torch.rand(shape, generator=self.g) < p
            special = torch.tensor([NAN, INF, -INF, 0.0])[torch.randint(0, 4, tuple(shape), generator=self.g)]
            t = torch.where(mask, special, t)
        t = t.to(dtype) if dtype.is_floating_point else t.nan_to_num(0, 0, 0).to(dtype)
        return self.strided(t)

    def strided(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and self.chance(0.15):  # same values, transposed strides
            return t.transpose(-1, -2).contiguous().transpose(-1, -2)
        return t

    def ints(self, low: int, high: int, shape, dtype=torch.int32) -> torch.Tensor:
        return torch.randint(low, max(high, low + 1), tuple(shape), generator=self.g).to(dtype)


def gen_rms_norm(q: Gen):
    dtype, hidden = q.dtype(), q.pick(0, 1, 3, 16, 67, 256)
    gamma_dims = [hidden] if q.chance(0.8) else [q.pick(0, 2, 3), hidden]
    lead = [q.pick(0, 1, 2, 5, 33) for _ in range(q.pick(0, 1, 1, 2))]
    gamma_shape = gamma_dims if q.chance(0.93) else [hidden + 1]
    x = q.floats(lead + gamma_dims, dtype)
    return (x, q.floats(gamma_shape, q.other_dtype(dtype)), q.pick(1e-6, 1e-5, 0.0)), {}


def gen_add_rms_norm(q: Gen):
    (x1, gamma, eps), _ = gen_rms_norm(q)
    shape = list(x1.shape) if q.chance(0.95) else [*x1.shape[:-1], x1.shape[-1] + 1]
    return (x1, q.floats(shape, q.other_dtype(x1.dtype)), gamma, eps), {}


def gen_swiglu(q: Gen):
    rank = q.pick(1, 2, 2, 3)
    shape = [q.pick(0, 1, 2, 4, 6, 64) for _ in range(rank)]
    dim = q.pick(-1, -1, 0, rank - 1, -rank) if q.chance(0.95) else q.pick(rank, -rank - 1)
    if q.chance(0.9) and -rank <= dim < rank:
        shape[dim] += shape[dim] % 2  # mostly even
    else:
        shape[dim % rank] = q.pick(1, 3, 9)
    return (q.floats(shape, q.other_dtype(q.dtype(), 0.03)), dim), {}


def gen_clipped_swiglu(q: Gen):
    (x, dim), _ = gen_swiglu(q)
    kwargs = dict(
        dim=dim,
        alpha=q.pick(1.702, 1.0, 0.5),
        limit=q.pick(7.0, 0.5, 1e4),
        bias=q.pick(1.0, 0.0, -0.5),
        interleaved=q.pick(True, False),
    )
    if q.chance(0.4):
        rows = max(1, x.shape[: dim % x.dim()].numel()) if -x.dim() <= dim < x.dim() else 1
        counts = [q.pick(0, 1, rows // 2, rows + 3) for _ in range(q.pick(1, 3))]
        shape, dtype = (
            ([len(counts)], torch.int64)
            if q.chance(0.9)
            else q.pick(([1, len(counts)], torch.int64), ([len(counts)], torch.int32))
        )
        kwargs["group_index"] = torch.tensor(counts, dtype=dtype).reshape(shape)
    return (x,), kwargs


def gen_linear(q: Gen):
    dtype = q.dtype()
    m, k, n = q.pick(0, 1, 3, 8, 9, 33), q.pick(0, 1, 17, 64), q.pick(0, 1, 5, 131)
    x_shape = [m, k] if q.chance(0.95) else [2, m, k]
    w_shape = [n, k] if q.chance(0.95) else [n, k + 1]
    bias = q.floats([n if q.chance(0.95) else n + 1], q.other_dtype(dtype)) if q.chance(0.5) else None
    return (q.floats(x_shape, dtype), q.floats(w_shape, q.other_dtype(dtype)), bias), {}


def gen_moe_gating_top_k_softmax(q: Gen):
    experts = q.pick(1, 2, 8, 16, 64)
    shape = [q.pick(0, 1, 7, 64), experts] if q.chance(0.8) else [2, q.pick(0, 3), experts]
    k = q.pick(1, 2, min(6, experts), experts) if q.chance(0.9) else q.pick(0, experts + 1)
    finished = None
    if q.chance(0.3):
        finished = torch.rand(shape[:-1], generator=q.g) < 0.3
        if q.chance(0.1):
            finished = finished.to(q.pick(torch.int32, torch.float32)) if q.chance(0.5) else finished[..., :1]
    return (q.floats(shape, q.other_dtype(q.dtype(), 0.03), grid=64), finished, k), {}


def gen_moe_gating_top_k(q: Gen):
    experts = q.pick(4, 8, 12, 16, 64)
    group_count = q.pick(*[d for d in (1, 2, 4, 8) if experts % d == 0]) if q.chance(0.93) else q.pick(0, 5)
    k_group = q.pick(1, max(1, group_count // 2), max(1, group_count)) if q.chance(0.95) else group_count + 1
    limit = experts // max(group_count, 1) * k_group
    k = q.pick(1, 2, min(6, max(limit, 1)), max(limit, 1)) if q.chance(0.93) else limit + 1
    dtype = q.other_dtype(q.dtype(), 0.03)
    bias = None
    if q.chance(0.6):
        bias = q.floats([experts if q.chance(0.95) else experts + 2], torch.float32, grid=8) / 8
        bias = bias.to(q.other_dtype(dtype) if dtype.is_floating_point else torch.float32)
    kwargs = dict(
        bias=bias,
        k_group=k_group,
        group_count=group_count,
        group_select_mode=q.pick(0, 1),
        renorm=0 if q.chance(0.97) else 1,
        norm_type=q.pick(0, 1) if q.chance(0.97) else 2,
        out_flag=q.chance(0.5),
        routed_scaling_factor=q.pick(1.0, 2.5),
        eps=q.pick(1e-20, 1e-3),
    )
    x = q.floats([q.pick(0, 1, 7, 64), experts], dtype, grid=64)
    if q.chance(0.3):  # hash mode (drawn last: the other cases keep their arguments)
        kwargs.update(hash_mode_tables(q, x.shape[0], experts, k))
    return (x, k), kwargs


def hash_mode_tables(q: Gen, rows: int, experts: int, k: int) -> dict:
    """``input_ids`` / ``tid2eid`` of moe_gating_top_k's hash mode; rarely out-of-range ids, a
    wrong shape or dtype, or one of the two missing (bad arguments)."""
    vocab = q.pick(1, 5, 50)
    low, high = (0, experts) if q.chance(0.95) else q.pick((-1, experts), (0, experts + 1))
    columns = max(k, 0) if q.chance(0.95) else k + 1
    tid2eid = q.strided(q.ints(low, high, [vocab, columns], q.pick(torch.int32, torch.int64)))
    input_ids = q.ints(
        0,
        vocab if q.chance(0.95) else vocab + 2,
        [rows if q.chance(0.95) else rows + 1],
        q.pick(torch.int32, torch.int64) if q.chance(0.97) else torch.float32,
    )
    tables = dict(input_ids=input_ids, tid2eid=tid2eid)
    if q.chance(0.04):
        del tables[q.pick("input_ids", "tid2eid")]
    return tables


def gen_moe_init_routing_v2(q: Gen):
    experts, k, rows = q.pick(1, 4, 16, 64), q.pick(1, 2, 6), q.pick(0, 1, 5, 40)
    k = min(k, experts) if q.chance(0.95) else k
    ids = q.ints(0, experts, [rows, k])
    if ids.numel() and q.chance(0.15):  # ids past the experts, negative, or huge (issue 14 item 5)
        ids.view(-1)[q.r.randrange(ids.numel())] = q.pick(-1, -7, experts, 2**31 - 1)
    if q.chance(0.05):
        ids = ids.to(q.pick(torch.int64, torch.float32))
    expert_num = q.pick(experts, experts, experts, -1, 0, 2**40, 2**31 - 1)
    flag = q.chance(0.5) and (expert_num < 2**20 or q.chance(0.1))  # huge count outputs: both must fail
    rng = []
    if q.chance(0.3) and expert_num > 0:
        start = q.r.randrange(min(expert_num, 64))
        rng = [start, q.pick(start + 1, min(expert_num, start + 3), expert_num)] if q.chance(0.9) else [start, start]
    kwargs = dict(
        scale=q.floats([rows if q.chance(0.95) else rows + 1], torch.float32) if q.chance(0.4) else None,
        offset=torch.zeros(rows) if q.chance(0.02) else None,
        active_num=q.pick(-1, 0, 1, rows * k // 2, 10**6) if q.chance(0.97) else -5,
        expert_num=expert_num,
        drop_pad_mode=0 if q.chance(0.97) else 1,
        expert_tokens_num_type=q.pick(0, 1, 2) if q.chance(0.97) else 3,
        expert_tokens_num_flag=flag,
        active_expert_range=rng,
        row_idx_type=q.pick(0, 1),
    )
    x_rows = rows if q.chance(0.95) else rows + 1
    return (q.floats([x_rows, q.pick(0, 1, 8, 96)], q.other_dtype(q.dtype(), 0.03)), ids), kwargs


def bad_group_list(q: Gen, counts: list[int], rows: int, gl_type: int) -> list[int]:
    """A group list that must be rejected: int64 wrap-around (issue 14 item 6), a negative count,
    a decreasing cumsum, or more rows than x has."""
    e = len(counts)
    kind = q.pick("wrap", "wrap_to_rows", "negative", "exceed")
    if kind == "wrap":  # counts sum to 2**64 (+ a few): 0 after an int64 wrap
        values = [2**62] * 4 + [0] * (e - 4) if e >= 4 else [2**63 - 1] * e
    elif kind == "wrap_to_rows":
        values = [2**63 - 1, 2**63 - 1, 2 + min(rows, 1)] + [0] * (e - 3) if e >= 3 else [2**63 - 1] * e
    elif kind == "negative":
        values = list(counts)
        values[q.r.randrange(e)] = -q.pick(1, 2**62)
    else:
        values = list(counts)
        values[q.r.randrange(e)] += rows + 1
    if gl_type == 0 and kind in ("negative", "exceed"):
        return [sum(values[: i + 1]) for i in range(e)]
    return values


def gen_grouped_matmul(q: Gen):
    dtype = q.dtype()
    k, n = q.pick(0, 1, 16, 40), q.pick(0, 1, 5, 64)
    act = q.pick(0, 0, 1, 2, 5) if q.chance(0.97) else 3
    if q.chance(0.2):  # list form: one matmul per (x[i], weight[i])
        count = q.pick(1, 2, 3)
        xs = [q.floats([q.pick(0, 1, 9), k], dtype) for _ in range(count)]
        ws = [q.floats([k if q.chance(0.95) else k + 1, n], q.other_dtype(dtype)) for _ in range(count)]
        bias = [q.floats([n], dtype) for _ in range(count)] if q.chance(0.3) else None
        return (xs, ws), dict(bias=bias, split_item=q.pick(0, 1, 2, 3), act_type=act)
    experts = q.pick(1, 2, 4, 7)
    counts = [q.pick(0, 0, 1, 3, 8, 9, 40) for _ in range(experts)]
    rows = sum(counts) + q.pick(0, 0, 3)
    gl_type = q.pick(0, 1)
    values = counts if gl_type == 1 else [sum(counts[: i + 1]) for i in range(experts)]
    if q.chance(0.2):
        values = bad_group_list(q, counts, rows, gl_type)
    if q.chance(0.5):  # Hugging Face's [E, N, K] storage, passed as its [E, K, N] transpose
        w = q.floats([experts, n, k], q.other_dtype(dtype)).transpose(1, 2)
    else:
        w = q.floats([experts, k, n], q.other_dtype(dtype))
    bias = [q.floats([experts, n], dtype)] if q.chance(0.4) else None
    kwargs = dict(
        bias=bias,
        group_list=torch.tensor(values, dtype=torch.int64),
        split_item=q.pick(0, 2, 3),
        group_type=0 if q.chance(0.97) else None,
        group_list_type=gl_type,
        act_type=act,
    )
    return ([q.floats([rows, k], dtype)], [w]), kwargs


def gen_moe_finalize_routing(q: Gen):
    dtype = q.dtype()
    n, k, h, experts = q.pick(0, 1, 5, 33), q.pick(1, 2, 6), q.pick(0, 1, 8, 64), q.pick(1, 4, 16)
    total = n * k
    expanded = total + q.pick(0, 0, 3)
    dst = torch.randperm(max(expanded, 1), generator=q.g)[:total].to(torch.int32)
    if total and q.chance(0.3):
        dst[torch.rand(total, generator=q.g) < 0.2] = -1  # pairs dropped by init_routing
    if total and q.chance(0.08):
        dst[q.r.randrange(total)] = expanded + q.pick(0, 5)  # out of range
    scales = q.floats([n, k], q.pick(torch.float32, dtype)) if q.chance(0.7) else None
    bias = q.floats([experts, h], dtype) if q.chance(0.4) else None
    experts_of = None
    if bias is not None or q.chance(0.2):
        experts_of = q.ints(0, experts, [n, k])
        if total and q.chance(0.1):
            experts_of.view(-1)[0] = q.pick(-1, experts)
    skip1 = q.floats([n, h], dtype) if q.chance(0.5) else None
    skip2 = q.floats([n, h if q.chance(0.95) else h + 1], dtype) if q.chance(0.3) else None
    return (
        q.floats([expanded, h], dtype),
        skip1,
        skip2,
        bias,
        scales,
        dst,
        experts_of,
        q.pick(0, 2, None),
        k if scales is None or q.chance(0.5) else q.pick(1, k + 1),
    ), {}


def gen_mla_prolog(q: Gen):
    dtype = q.dtype()
    tokens, he, hcq, heads, d, dr, hckv = q.pick(0, 1, 5), 16, 12, q.pick(1, 2), q.pick(0, 4), 4, 8
    lead = [tokens] if q.chance(0.7) else [2, tokens]
    lora = q.chance(0.7)
    q_in = hcq if lora else he
    args = (
        q.floats(lead + [he], dtype),
        q.floats([he, hcq], dtype) if lora else None,
        q.floats([q_in, heads * (d + dr) + (0 if q.chance(0.95) else 1)], dtype),
        q.floats([heads, d, hckv], dtype) if q.chance(0.4) else None,
        q.floats([he, hckv + dr], q.other_dtype(dtype)),
        q.floats([hcq], dtype) if lora else None,
        q.floats([hckv], dtype),
        q.floats(lead + [dr], dtype),
        q.floats(lead + [dr if q.chance(0.95) else dr + 1], dtype),
    )
    return args, dict(head_num=heads if q.chance(0.95) else 0, rope_interleave=q.chance(0.5))


def eplb_tables(q: Gen, experts: int):
    replicas = q.ints(1, 3, [experts], torch.int64)
    slots = int(replicas.sum())
    perm = torch.randperm(slots, generator=q.g)
    log2phy = torch.full((experts, 2), -1, dtype=torch.int64)
    at = 0
    for e, r in enumerate(replicas.tolist()):
        log2phy[e, :r] = perm[at : at + r]
        at += r
    return log2phy, replicas, slots


# The eplb ops get valid expert ids only: an id out of range raises a raw IndexError / RuntimeError
# from their reference (reported on issue 14; ascend_passes/ops/eplb.py is not this test's to change).
def gen_eplb_map(q: Gen):
    experts = q.pick(1, 4, 9)
    log2phy, replicas, _ = eplb_tables(q, experts)
    ids = q.ints(0, experts, [q.pick(0, 1, 7), q.pick(1, 2)], q.pick(torch.int32, torch.int64))
    if q.chance(0.05):
        ids = ids.float()
    if q.chance(0.05):
        log2phy = log2phy.int()
    if q.chance(0.05):
        replicas = replicas[:-1]
    return (ids, log2phy, replicas), dict(rank=q.pick(0, 1, 3))


def gen_eplb_record_load(q: Gen):
    experts = q.pick(1, 4, 9)
    _, _, slots = eplb_tables(q, experts)
    ids = q.ints(0, slots, [q.pick(0, 1, 7), q.pick(1, 2)], q.pick(torch.int32, torch.int64))
    rng = [] if q.chance(0.6) else ([0, slots] if q.chance(0.5) else [slots // 2, slots])
    if q.chance(0.05):
        rng = [slots, slots + 1]
    return (torch.zeros(slots, dtype=torch.int64), ids, torch.ones(1, dtype=q.pick(torch.bool, torch.int64))), dict(
        active_expert_range=rng
    )


def gen_eplb_logical_weight(q: Gen):
    experts = q.pick(1, 4, 9)
    log2phy, replicas, slots = eplb_tables(q, experts)
    held = slots if q.chance(0.9) else max(slots - 1, 0)
    return (
        q.floats([held, 3, 2], q.dtype()),
        log2phy,
        replicas,
        torch.zeros(slots, dtype=torch.int64),
        torch.ones(1, dtype=torch.bool),
    ), {}


def _finite(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t.isfinite(), t, torch.zeros((), dtype=t.dtype)) if t.dtype.is_floating_point else t


def gen_attention(q: Gen):
    dtype = q.dtype()
    b, n, length = q.pick(0, 1, 2), q.pick(1, 3), q.pick(0, 1, 5, 64, 70)
    causal = q.chance(0.5)
    kv = length if causal and q.chance(0.9) else q.pick(0, 1, 7, 65)
    d, dv = q.pick(8, 12, 16), q.pick(4, 8, 12, 20)
    k_heads = n if q.chance(0.95) else n + 1
    k_dim = d if q.chance(0.95) else d + 2
    v_len = kv if q.chance(0.95) else kv + 1
    # finite q, k, v: torch's flash kernel (the reference) turns NaN / Inf scores into per-column patterns no
    # other kernel reproduces (a row with one NaN score: [nan, nan, 0.0, ...], another [0, 0, inf, ...]);
    # ascend.attention's own semantics (a NaN or +Inf score: a NaN row) are in tests/test_attention_kernel.py
    query = _finite(q.floats([b, n, length, d], dtype))
    key = _finite(q.floats([b, k_heads, kv, k_dim], q.other_dtype(dtype)))
    value = _finite(q.floats([b, n, v_len, dv], q.other_dtype(dtype)))
    scale = q.pick(0.25, 0.125, 1.0) if q.chance(0.95) else q.pick(0.0, -0.5)
    mask = None
    if (not causal and q.chance(0.6)) or q.chance(0.03):  # with is_causal: a bad argument
        shape = q.pick([length, kv], [b, n, length, kv], [1, n, length, kv], [b, 1, length, kv])
        if q.chance(0.05):
            shape = q.pick([n, length, kv], [length, kv + 1])  # 3-D, or not broadcasting
        mask_dtype = q.pick(torch.float32, dtype) if q.chance(0.95) else torch.float16
        mask = q.floats(shape, torch.float32)
        if mask.numel() and q.chance(0.5):  # hidden keys, sometimes whole rows
            mask = mask.masked_fill(torch.rand(shape, generator=q.g) < q.pick(0.3, 1.0), -INF)
        mask = mask.to(mask_dtype)
    return (query, key, value, scale, causal, mask), {}


GENERATORS = {name: globals()[f"gen_{name}"] for name in CASES}


# ------------------------------------------------------------------------------------ checking
def call(fn, args, kwargs):
    """``("ok", result)`` or ``("raised", exception)``."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as exc:  # compared below; anything unexpected is reported
        return "raised", exc


def leaves(result):
    return [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


def mismatch(got, expected) -> str | None:
    """Why the C++ result differs from the reference's, or None."""
    got, expected = leaves(got), leaves(expected)
    if len(got) != len(expected):
        return f"{len(got)} outputs vs {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        if g.dtype != e.dtype or g.shape != e.shape:
            return f"output {i}: {g.dtype}{tuple(g.shape)} vs {e.dtype}{tuple(e.shape)}"
        if not e.dtype.is_floating_point:
            if not torch.equal(g, e):
                return f"output {i}: integers differ at {(g != e).nonzero()[:3].tolist()}"
            continue
        g64, e64 = g.double(), e.double()
        if not torch.equal(g64.isnan(), e64.isnan()):
            return f"output {i}: NaN at different places ({(g64.isnan() != e64.isnan()).nonzero()[:3].tolist()})"
        inf_g, inf_e = g64.isinf() * g64.sign(), e64.isinf() * e64.sign()
        if not torch.equal(inf_g, inf_e):
            return f"output {i}: Inf at different places ({(inf_g != inf_e).nonzero()[:3].tolist()})"
        finite = e64.isfinite()
        if finite.any():
            tol = TOLERANCE[e.dtype]
            scale = max(1.0, e64[finite].abs().max().item())
            err = (g64[finite] - e64[finite]).abs() - tol * e64[finite].abs()
            if err.max().item() > tol * scale:
                return f"output {i}: differs by {err.max().item():.3g} (allowed {tol * scale:.3g})"
    return None


def same_error(got: Exception, expected: Exception) -> str | None:
    if type(got) is not type(expected):
        return f"C++ raised {type(got).__name__}: {got}; reference raised {type(expected).__name__}: {expected}"
    if isinstance(expected, ValueError) and str(got) != str(expected):
        return f"messages differ: C++ {str(got)!r}; reference {str(expected)!r}"
    return None


def check_kernel_case(name: str, args, kwargs) -> tuple[str, str | None]:
    from ascend_passes.ops import reference

    got = call(getattr(torch.ops.ascend_kernels, name), args, kwargs)
    expected = call(getattr(reference, name), args, kwargs)
    if got[0] == "ok" and expected[0] == "ok":
        return "equal", mismatch(got[1], expected[1])
    if got[0] == "raised" and expected[0] == "raised":
        if not isinstance(expected[1], (ValueError, RuntimeError, MemoryError)):
            return "error", f"reference raised a raw {type(expected[1]).__name__}: {expected[1]}"
        return "error", same_error(got[1], expected[1])
    which = "C++" if got[0] == "raised" else "reference"
    exc = got[1] if got[0] == "raised" else expected[1]
    return "error", f"only the {which} raised: {type(exc).__name__}: {exc}"


def check_reference_case(name: str, args, kwargs) -> tuple[str, str | None]:
    """An op without a C++ kernel: its reference against its fake implementation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = getattr(torch.ops.ascend, name)
    real = call(op, [a.clone() if isinstance(a, torch.Tensor) else a for a in args], kwargs)
    mode = FakeTensorMode()
    fake_args = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
    with mode:
        fake = call(op, fake_args, kwargs)
    if real[0] == "raised" and not isinstance(real[1], ValueError):
        return "error", f"raw {type(real[1]).__name__}: {real[1]}"
    if real[0] == "ok" and fake[0] == "ok":
        ours, theirs = leaves(real[1]), leaves(fake[1])
        shapes = [(t.dtype, tuple(t.shape)) for t in ours]
        fake_shapes = [(t.dtype, tuple(t.shape)) for t in theirs]
        return "equal", None if shapes == fake_shapes else f"shapes {shapes} vs fake {fake_shapes}"
    if real[0] == "raised" and fake[0] == "raised":
        return "error", same_error(fake[1], real[1])
    if real[0] == "raised":  # a value the fake implementation cannot see (an id out of range)
        return "error", None
    return "error", f"only the fake implementation raised: {type(fake[1]).__name__}: {fake[1]}"


def describe(args, kwargs) -> str:
    def one(a):
        if isinstance(a, torch.Tensor):
            return f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}"
        if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
            return "[" + ", ".join(one(t) for t in a) + "]"
        return repr(a)

    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])


def fuzz(seed: int = SEED, scale: float = 1.0) -> dict:
    """Run every op's cases; returns ``{"counts": {op: {"equal": n, "error": n}}, "failures": [...],
    "seconds": s}``."""
    from ascend_passes.ops import KERNEL_OPS  # registers the ops, loads the kernels; from the records

    report = {"counts": {}, "failures": [], "seconds": 0.0}
    start = time.perf_counter()
    for op_index, (name, cases) in enumerate(CASES.items()):
        counts = report["counts"].setdefault(name, {"equal": 0, "error": 0})
        check = check_kernel_case if name in KERNEL_OPS else check_reference_case
        for case in range(max(1, int(cases * scale))):
            case_seed = seed * 1_000_003 + op_index * 10_007 + case
            args, kwargs = GENERATORS[name](Gen(case_seed))
            try:
                outcome, problem = check(name, args, kwargs)
            except Exception:  # a crash of the comparison itself
                outcome, problem = "error", traceback.format_exc(limit=3)
            counts[outcome] += 1
            if problem:
                report["failures"].append(
                    f"{name} case {case} (seed {case_seed}): {problem}\n    args: {describe(args, kwargs)}"
                )
    report["seconds"] = time.perf_counter() - start
    return report


# ------------------------------------------------------------------------------------ test
def test_ops_fuzz_cpp_equals_reference_under_a_memory_cap():
    from _helpers import run_with_memory_cap, skip_unless

    from ascend_passes import kernels

    skip_unless(kernels.available(), "C++ kernels not built or disabled")
    code = f"import json, test_fuzz_ops as f; print('REPORT ' + json.dumps(f.fuzz({SEED})))"
    run = run_with_memory_cap(code, MEMORY_CAP, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("REPORT ")]
    assert run.returncode == 0 and lines, f"rc {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    report = json.loads(lines[-1][len("REPORT ") :])
    failures = report["failures"]
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:15])
    import ascend_passes.ops as ops

    assert set(CASES) == set(ops.OPS)  # every op record is fuzzed
    for name, cases in CASES.items():  # every op ran all its cases, with results and with errors
        counts = report["counts"][name]
        assert counts["equal"] + counts["error"] == cases
        assert counts["equal"] >= cases // 2 and counts["error"] >= 2, (name, counts)


if __name__ == "__main__":
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else SEED
    result = fuzz(seed, float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)
    print(json.dumps(result["counts"]), f"{result['seconds']:.1f} s")
    print("\n".join(result["failures"]) or "no failures")
    sys.exit(1 if result["failures"] else 0)
