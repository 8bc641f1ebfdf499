"""The contract between the models and the expert tiers.

A routed expert is stored, cached and computed as ONE flat record in the checkpoint dtype,
padded to 4 KiB so a record read with O_DIRECT lands directly in a cache slot (the store's
record layout equals a compute slot). Its matrices come in one of two orders, chosen for the
device that computes from the slot:
  rows  gate [I,H] | up [I,H] | down [H,I], as the checkpoint holds them: the GPU kernels' order;
  cols  the same matrices transposed, gate and up side by side: gate_up^T [H,2I] | down^T [I,H].
        A one-token GEMV over a [in, out] matrix streams at about twice the bandwidth of one over
        [out, in] in the CPU's BLAS (bench/results/gemv_orientation.json), and gate|up is one matrix.
views() gives the same logical (gate, up, down) in both orders, so the arithmetic never changes.

Models route (choose experts and weights) and hand the rest to an ExpertProvider:
  out = provider.forward(layer, x, topk_ids, topk_weights)
Providers differ only in *where* the expert weights live (all in memory, or tiered:
GPU slots ← pinned RAM tier ← O_DIRECT store). They must never change a result.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

ALIGN = 4096

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


ORDERS = ("rows", "cols")


def order_for(device) -> str:
    """The record order a device computes fastest from: cols on the CPU, rows for the GPU kernels."""
    return "cols" if torch.device(device).type == "cpu" else "rows"


@dataclass(frozen=True)
class ExpertLayout:
    """Byte layout of one expert record (see the module docstring for the two orders), padded to ALIGN.
    quant != "none": a quantized record (engine.quant.records, which owns those layouts); its dtype is
    uint8 (the bytes a slot holds) and views() gives an engine.quant.expert.QuantExpert, which unpacks to
    the same logical (gate, up, down), dequantized, and computes with the device's quantized kernel."""

    hidden: int
    intermediate: int
    dtype: torch.dtype
    order: str = "rows"
    quant: str = "none"

    def __post_init__(self):
        assert self.hidden > 0 and self.intermediate > 0, "expert shape must be positive"
        assert self.order in ORDERS, f"record order {self.order!r} is not one of {ORDERS}"
        if self.quant == "none":
            assert self.dtype in _DTYPE_BYTES, f"unsupported expert dtype {self.dtype}"
        else:
            assert self.dtype == torch.uint8, f"quantized records are bytes (uint8), not {self.dtype}"
            from engine.quant.records import QuantLayout
            object.__setattr__(self, "_q", QuantLayout(self.hidden, self.intermediate, self.quant, self.order))

    @property
    def quantized(self):
        """The engine.quant.records.QuantLayout of a quantized record, else None."""
        return getattr(self, "_q", None)

    @property
    def itemsize(self) -> int:
        return 1 if self.quantized else _DTYPE_BYTES[self.dtype]

    @property
    def matrix_elems(self) -> int:
        return self.hidden * self.intermediate

    @property
    def payload_bytes(self) -> int:
        if self.quantized:
            return self.quantized.payload_bytes
        return 3 * self.matrix_elems * self.itemsize

    @property
    def record_bytes(self) -> int:
        return -(-self.payload_bytes // ALIGN) * ALIGN

    @property
    def record_elems(self) -> int:
        return self.record_bytes // self.itemsize

    def views(self, slot: torch.Tensor):
        """(gate [I,H], up [I,H], down [H,I]) as views into a flat slot tensor of record_elems in self.dtype
        (in the cols order they are transposed views: the same values, other strides). A quantized
        record: a QuantExpert over the slot (it unpacks to the dequantized three)."""
        if self.quantized:
            from engine.quant.expert import QuantExpert
            return QuantExpert(self.quantized, slot)
        n, h, i = self.matrix_elems, self.hidden, self.intermediate
        if self.order == "cols":
            gate_up_t = slot[0:2 * n].view(h, 2 * i)
            return gate_up_t[:, :i].t(), gate_up_t[:, i:].t(), slot[2 * n:3 * n].view(i, h).t()
        gate = slot[0:n].view(i, h)
        up = slot[n:2 * n].view(i, h)
        down = slot[2 * n:3 * n].view(h, i)
        return gate, up, down

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """One record (flat, record_elems long, zero padding) from the three matrices (quantized at
        pack time for int8/int4; GGUF blocks go through QuantLayout.pack_blocks)."""
        assert gate.shape == (self.intermediate, self.hidden), f"gate shape {tuple(gate.shape)}"
        assert up.shape == (self.intermediate, self.hidden), f"up shape {tuple(up.shape)}"
        assert down.shape == (self.hidden, self.intermediate), f"down shape {tuple(down.shape)}"
        if self.quantized:
            return self.quantized.pack(gate, up, down)
        rec = torch.zeros(self.record_elems, dtype=self.dtype)
        for view, m in zip(self.views(rec), (gate, up, down)):
            view.copy_(m)
        return rec


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert, as transformers computes it: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class ExpertProvider(Protocol):
    """Where routed experts live. Shapes: x [T,H], topk_ids [T,K] (int64), topk_weights [T,K] (x.dtype)."""

    layout: ExpertLayout

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """Σ_k topk_weights[t,k] · expert_{topk_ids[t,k]}(x[t]) for every token t → [T,H], x.dtype."""
        ...

    def counters(self) -> dict:
        """Tier counters, e.g. {"served": {"gpu": n, "ram": n, "store": n}, "store_read_bytes": n}."""
        ...


def moe_reference(x, topk_ids, topk_weights, get_views) -> torch.Tensor:
    """The plain per-expert loop every provider must agree with; get_views(e) -> (gate, up, down)."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        tok, k = (topk_ids == e).nonzero(as_tuple=True)
        gate, up, down = get_views(e)
        y = expert_ffn(x[tok], gate.to(x.dtype), up.to(x.dtype), down.to(x.dtype))
        out.index_add_(0, tok, y * topk_weights[tok, k, None].to(y.dtype))
    return out


# ---------------------------------------------------------------- the fast path: same arithmetic, fewer syncs, two cores

def default_threads() -> int:
    """torch intra-op threads for the engine's CPU decode: 2 where the process may use 2 CPUs or more.
    The work split between them is a pair of experts (or two column halves of lm_head) in one batched
    matmul; bench/smollm2_demo_speed.py measured 2 > 1 on this 2-core machine, more were not measured."""
    return min(2, len(os.sched_getaffinity(0)))


def set_compute_threads(n: int | None = None) -> int:
    """torch's intra-op threads for the engine (None: default_threads()); returns the number set."""
    n = default_threads() if n is None else n
    if n < 1:
        raise ValueError(f"threads is {n}; it must be at least 1")
    torch.set_num_threads(n)
    return n


def _as_batch(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """Two equally shaped, equally strided views of ONE storage as a [2, ...] view (no copy), lower address
    first; (view, swapped). None when they cannot be (different storages or dtypes)."""
    if (a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype or a.device != b.device
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()):
        return None
    swapped = b.storage_offset() < a.storage_offset()
    lo, hi = (b, a) if swapped else (a, b)
    d = hi.storage_offset() - lo.storage_offset()
    if d == 0:
        return None
    return lo.as_strided((2, *lo.shape), (d, *lo.stride()), lo.storage_offset()), swapped


def _gate_up_matrix(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """gate and up of one record as ONE matrix that x multiplies in one matmul, and whether it is stored
    transposed: rows order [2I, H] (up right below gate), cols order [H, 2I] (up right beside gate).
    None when the views do not lie that way."""
    inter, hidden = gate.shape
    size = gate.element_size()
    if gate.stride() == (hidden, 1) and up.data_ptr() == gate.data_ptr() + gate.numel() * size:
        return gate.as_strided((2 * inter, hidden), gate.stride()), False
    if gate.stride() == (1, 2 * inter) and up.stride() == gate.stride() and up.data_ptr() == gate.data_ptr() + inter * size:
        return gate.as_strided((hidden, 2 * inter), (2 * inter, 1)), True
    return None


def pair_ffn(xa: torch.Tensor, xb: torch.Tensor, va, vb) -> tuple[torch.Tensor, torch.Tensor] | None:
    """expert_ffn for two experts at once — (expert_ffn(xa, *va), expert_ffn(xb, *vb)) — as batched matmuls
    over the records where they lie (gate|up read as one matrix), so torch's intra-op threads take one
    expert each, each GEMV running sequentially (a lone one-token GEMV runs on one thread here, and on
    some CPUs is split by the BLAS in another summation order: see single_ffn). Every element is the
    dot product a sequential GEMV computes (tests/engine/test_speed_paths.py checks bitwise), in either
    record order.

    None (compute them one by one) unless the records are views of one storage in x's dtype and rows of
    `hidden` and `intermediate` elements keep 64-byte alignment: the BLAS kernel's path, hence its
    summation order, depends on where a vector starts, and the batch's second vectors start a row in."""
    (ga, ua, da), (gb, ub, db) = va, vb
    inter, hidden = ga.shape
    size = ga.element_size()
    if xa.shape != xb.shape or ga.dtype != xa.dtype or (hidden * size) % 64 or (inter * size) % 64:
        return None
    mats = _gate_up_matrix(ga, ua), _gate_up_matrix(gb, ub)
    if None in mats or mats[0][1] != mats[1][1]:
        return None
    cols = mats[0][1]
    # The batch's matrices as the GEMM's right operand, [2, K, N] (a transposed view in the rows order).
    gate_up = _as_batch(mats[0][0], mats[1][0])
    down = _as_batch(da.t(), db.t()) if cols else _as_batch(da, db)
    if gate_up is None or down is None or gate_up[1] != down[1]:
        return None
    swapped = down[1]
    rhs_gu, rhs_d = (gate_up[0], down[0]) if cols else (gate_up[0].transpose(1, 2), down[0].transpose(1, 2))
    x = torch.stack((xb, xa) if swapped else (xa, xb))
    gu = torch.bmm(x, rhs_gu)                                                    # [2, M, 2I]
    # silu(gate) * up per expert on contiguous [M, I] tensors: the elementwise loops see what expert_ffn's do.
    h = torch.stack([F.silu(gu[j, :, :inter].contiguous()) * gu[j, :, inter:].contiguous() for j in range(2)])
    y = torch.bmm(h, rhs_d)                                                      # [2, M, H]
    return (y[1], y[0]) if swapped else (y[0], y[1])


def single_ffn(x: torch.Tensor, views) -> torch.Tensor | None:
    """expert_ffn for one expert and one token, as two batched GEMVs of two halves each (gate and up; the
    two halves of down's outputs), so both intra-op threads work and every GEMV runs sequentially inside
    the batch. A lone GEMV may instead be split by the BLAS itself across threads, summing in another
    order on some CPUs (MKL on Intel Xeons does, tests/engine/test_speed_paths.py); a batch never is, so
    a one-token expert gives the same bits alone, in a pair (pair_ffn) or on any number of threads.
    None unless the record lies as its order says and every half starts 64-byte aligned."""
    gate, up, down = views
    inter, hidden = gate.shape
    size = gate.element_size()
    mat = _gate_up_matrix(gate, up)
    if mat is None or gate.dtype != x.dtype or x.shape[0] != 1 or (inter * size) % 64 or hidden % 2 \
            or (hidden // 2 * size) % 64:
        return None
    m, cols = mat
    x2 = x.reshape(1, 1, hidden).expand(2, 1, hidden)
    if cols:    # m = [gate^T | up^T] as [H, 2I]; down^T [I, H] split by output columns
        gu = torch.bmm(x2, m.view(hidden, 2, inter).transpose(0, 1))
        down_halves = down.t().view(inter, 2, hidden // 2).transpose(0, 1)
    else:       # m = [gate; up] as [2I, H]; down [H, I] split by output rows
        gu = torch.bmm(x2, m.view(2, inter, hidden).transpose(1, 2))
        down_halves = down.view(2, hidden // 2, inter).transpose(1, 2)
    h = F.silu(gu[0].contiguous()) * gu[1].contiguous()                          # [1, I], as expert_ffn's
    return torch.bmm(h.reshape(1, 1, inter).expand(2, 1, inter), down_halves).reshape(1, hidden)




class Projection:
    """One of the model's own weights, [out, in] as the checkpoint has it, held the way its device
    multiplies fastest. On the CPU: transposed ([in, out], contiguous) — the orientation torch's BLAS
    streams at about twice the bandwidth for a one-row GEMV — and a one-row GEMV goes out as two column
    halves in one batched matmul: two intra-op threads share it, and each half runs sequentially, so the
    result has the same bits on one thread or several (a lone GEMV may be split by the BLAS itself, in
    another summation order: see single_ffn). Every element is the dot product a sequential matmul
    computes (bitwise: tests/engine/test_speed_paths.py). Elsewhere: F.linear, as given."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.cpu = weight.device.type == "cpu"
        self.weight = weight.t().contiguous() if self.cpu else weight      # CPU: [in, out]
        out, size = self.out_features, weight.element_size()
        self.halves = self.cpu and out % 2 == 0 and (out // 2 * size) % 64 == 0   # each half's outputs 64-byte aligned

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cpu:
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:                # the bias added inside the GEMM, rounded once (as F.linear)
            return torch.addmm(self.bias, x.reshape(-1, self.in_features), self.weight).view(*x.shape[:-1], -1)
        if self.halves and x.numel() == x.shape[-1] and torch.get_num_threads() >= 2:
            n = self.out_features // 2
            y = torch.bmm(x.reshape(1, 1, -1).expand(2, 1, -1), self.weight.view(-1, 2, n).transpose(0, 1))
            return y.reshape(*x.shape[:-1], self.out_features)               # [2, 1, out/2] -> one row
        return torch.matmul(x, self.weight)


@dataclass(frozen=True)
class Route:
    """The tokens routed to one expert: x rows `tokens`, each through its top-k position `ks`."""

    expert: int
    tokens: list[int]               # ascending
    ks: list[int]


def group_routes(topk_ids: torch.Tensor) -> list[Route]:
    """topk_ids [T,K] grouped by expert, experts ascending and tokens ascending within each: the order
    moe_reference visits them in (torch.unique, then nonzero), from ONE read of topk_ids to the host
    instead of one per expert."""
    by_expert: dict[int, tuple[list[int], list[int]]] = {}
    for t, row in enumerate(topk_ids.tolist()):
        for k, e in enumerate(row):
            toks, ks = by_expert.setdefault(e, ([], []))
            toks.append(t)
            ks.append(k)
    return [Route(e, *by_expert[e]) for e in sorted(by_expert)]


def moe_forward(x: torch.Tensor, topk_weights: torch.Tensor, routes: list[Route],
                resolve: Callable[[list[int]], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
                wave: int) -> torch.Tensor:
    """moe_reference's arithmetic, operation for operation: each expert's FFN on its tokens, accumulated
    into zeros in ascending expert order. The experts come `wave` at a time from resolve(experts) -> their
    (gate, up, down) views (a tiered provider may reuse a wave's slots for the next one). On the CPU with
    two or more threads, neighbours in a wave that each serve one token (a decode step) are computed as
    a pair (pair_ffn), a one-token expert without a neighbour in halves (single_ffn); more tokens per
    expert are GEMMs torch's BLAS already spreads over its threads. Bitwise equal to moe_reference on
    one thread, whatever the wave (tests/engine/test_speed_paths.py)."""
    one_token = x.shape[0] == 1
    out = None if one_token else torch.zeros_like(x)
    paired = x.device.type == "cpu" and torch.get_num_threads() >= 2

    def accumulate(r: Route, y: torch.Tensor):
        nonlocal out
        if one_token:
            # One row: zeros + y*w + y'*w' ... in expert order, without the zeros (0 + a is a) or an index_add.
            yw = y * topk_weights[:, r.ks[0]:r.ks[0] + 1].to(y.dtype)
            out = yw if out is None else out + yw
        else:
            tokens = torch.tensor(r.tokens, device=x.device)
            out.index_add_(0, tokens, y * topk_weights[tokens, torch.tensor(r.ks, device=x.device), None].to(y.dtype))

    for i in range(0, len(routes), wave):
        chunk = routes[i:i + wave]
        views = resolve([r.expert for r in chunk])
        j = 0
        while j < len(chunk):
            r = chunk[j]
            ffn = getattr(views[j], "ffn", None)        # a quantized record computes with its own kernel
            if ffn is not None:
                accumulate(r, ffn(x[r.tokens]))
                j += 1
                continue
            if paired and j + 1 < len(chunk) and len(r.tokens) == len(chunk[j + 1].tokens) == 1:
                ys = pair_ffn(x[r.tokens], x[chunk[j + 1].tokens], views[j], views[j + 1])
                if ys is not None:
                    accumulate(r, ys[0])
                    accumulate(chunk[j + 1], ys[1])
                    j += 2
                    continue
            y = single_ffn(x[r.tokens], views[j]) if paired and len(r.tokens) == 1 else None
            if y is None:
                gate, up, down = views[j]
                y = expert_ffn(x[r.tokens], gate.to(x.dtype), up.to(x.dtype), down.to(x.dtype))
            accumulate(r, y)
            j += 1
    return out if out is not None else torch.zeros_like(x)


class InMemoryExperts:
    """Every expert of every layer held as packed records in one tensor per layer (reference / all-resident)."""

    def __init__(self, layout: ExpertLayout, records: dict[int, torch.Tensor]):
        # records[layer] : [n_experts, record_elems] in layout.dtype
        self.layout = layout
        self.records = records
        self._served = 0

    def forward(self, layer, x, topk_ids, topk_weights):
        recs = self.records[layer]
        self._served += int(topk_ids.numel())
        return moe_forward(x, topk_weights, group_routes(topk_ids),
                           lambda experts: [self.layout.views(recs[e]) for e in experts], len(recs))

    def counters(self) -> dict:
        return {"served": {"gpu": 0, "ram": self._served, "store": 0}, "store_read_bytes": 0}
