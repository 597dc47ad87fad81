"""The native (SM100) MXFP8 path, checked on CPU against emulators of the kernels' contract.

No Blackwell machine is available, so `torch._scaled_mm` and `F.scaled_grouped_mm` are replaced
by float64 emulators written from the documented contract (PyTorch's own MX tests and cuBLAS's
block-scaling layout): e4m3 data, e8m0 scales swizzled per matrix (un-swizzled here with
PyTorch's reference `to_blocked` applied to an index matrix, not with our layout code), the
second operand column-major, token groups given by int32 end offsets, each group's blocked scale
matrix following the previous group's. Rows the kernel does not own come back as NaN, so a
caller that reads them fails. The native path must then reproduce the emulated path (which is
tested against the OCP oracle in test_mx.py) up to the bf16 output rounding.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.common_quantized import to_blocked

from model.ops import mx_linear as mxl
from model.ops import mx_native
from model.ops.mx import mx_quantize
from model.ops.token_groups import TokenGroups

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def _ru(n: int, m: int) -> int:
    return -(-n // m) * m


def _unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """One blocked scale matrix (bytes) -> its [rows, cols] exponents, via the reference swizzle."""
    R, C = _ru(rows, 128), _ru(cols, 4)
    assert flat.numel() == R * C, (flat.numel(), R, C)
    src = to_blocked(torch.arange(R * C).reshape(R, C))  # blocked position -> source index
    plain = torch.empty(R * C, dtype=torch.int64)
    plain[src] = flat.view(torch.uint8).to(torch.int64)
    return plain.reshape(R, C)[:rows, :cols]


def _dequant(data: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """e4m3 [rows, K] with exponent bytes [rows, K/32] -> float64."""
    assert data.dtype == E4M3
    s = torch.exp2(exps.double() - 127).repeat_interleave(32, dim=1)
    return data.double() * s


def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype=None, **kw):
    assert not kw and out_dtype == torch.bfloat16
    M, K = a.shape
    N = b.shape[1]
    assert a.is_contiguous() and b.t().is_contiguous(), "a row-major, b column-major"
    assert K % 32 == 0 and scale_a.dtype == E8M0 and scale_b.dtype == E8M0
    A = _dequant(a, _unswizzle(scale_a, M, K // 32))
    B = _dequant(b.t(), _unswizzle(scale_b, N, K // 32))
    return (A @ B.T).to(out_dtype)


def fake_scaled_grouped_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a=None,
                           swizzle_b=None, bias=None, offs=None, output_dtype=None, **kw):
    assert recipe_a == recipe_b == F.ScalingType.BlockWise1x32 and bias is None and not kw
    assert swizzle_a == swizzle_b == F.SwizzleType.SWIZZLE_32_4_4
    assert output_dtype == torch.bfloat16 and offs.dtype == torch.int32 and offs.ndim == 1
    assert a.dtype == b.dtype == E4M3 and scale_a.dtype == scale_b.dtype == E8M0
    assert a.is_contiguous() and b.transpose(-2, -1).is_contiguous(), "b must be column-major"
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    assert all(e >= s for s, e in zip(starts, ends))
    assert ends[-1] <= a.shape[-1 if b.ndim == 2 else 0]
    sa, sb = scale_a.reshape(-1), scale_b
    if b.ndim == 3:  # 2d x 3d: groups along the rows of a, one [K, N] matrix per group
        K, N = b.shape[1:]
        out = torch.full((a.shape[0], N), float("nan"), dtype=torch.float64)
        base = 0
        for g, (s, e) in enumerate(zip(starts, ends)):
            m = e - s
            assert m % 32 == 0, "groups of rows are padded to 32"
            n_a = _ru(m, 128) * _ru(K // 32, 4)
            A = _dequant(a[s:e], _unswizzle(sa[base:base + n_a], m, K // 32))
            base += n_a
            B = _dequant(b[g].t(), _unswizzle(sb[g], N, K // 32))
            out[s:e] = A @ B.T
        return out.to(output_dtype)
    M, N = a.shape[0], b.shape[1]  # 2d x 2d: groups along the contraction
    out = torch.empty(len(ends), M, N, dtype=torch.float64)
    base_a = base_b = 0
    sb = scale_b.reshape(-1)
    for g, (s, e) in enumerate(zip(starts, ends)):
        k = e - s
        assert k % 32 == 0, "contraction groups start on 32-element blocks"
        n_a, n_b = _ru(M, 128) * _ru(k // 32, 4), _ru(N, 128) * _ru(k // 32, 4)
        A = _dequant(a[:, s:e], _unswizzle(sa[base_a:base_a + n_a], M, k // 32))
        B = _dequant(b[s:e].t(), _unswizzle(sb[base_b:base_b + n_b], N, k // 32))
        base_a, base_b = base_a + n_a, base_b + n_b
        out[g] = A @ B.T
    return out.to(output_dtype)


@pytest.fixture
def native(monkeypatch):
    """Force the native backend on CPU with the kernels replaced by their emulators."""
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(F, "scaled_grouped_mm", fake_scaled_grouped_mm)
    monkeypatch.setenv("K3_MX_BACKEND", "native")
    mxl._backend_for.cache_clear()
    yield
    monkeypatch.delenv("K3_MX_BACKEND")
    mxl._backend_for.cache_clear()


def test_blocked_scales_match_reference_swizzle():
    for rows, cols in ((128, 4), (130, 7), (256, 64), (3, 1)):
        raw = torch.randint(0, 255, (2, rows, cols), dtype=torch.uint8)
        ours = mx_native.blocked_scales(raw.view(E8M0)).view(torch.uint8)
        for i in range(2):
            assert torch.equal(ours[i], to_blocked(raw[i]))


@pytest.mark.parametrize("sizes", [[5, 0, 70, 32], [0, 0, 1], [128, 97]])
def test_group_layout_and_grouped_scales_match_per_group_reference(sizes):
    sizes_t = torch.tensor(sizes)
    S = sum(sizes)
    layout = TokenGroups(sizes_t, S)
    padded = [max(32, _ru(s, 32)) for s in sizes]
    assert layout.offs.tolist() == torch.tensor(padded).cumsum(0).tolist()
    assert layout.capacity % 32 == 0 and layout.capacity >= sum(padded)
    x = torch.randn(S, 3)
    xp = layout.scatter(x)
    starts = [0] + layout.offs.tolist()[:-1]
    for g, (st, n) in enumerate(zip(starts, sizes)):  # real rows first, zeros after
        assert torch.equal(xp[st:st + n], x[sum(sizes[:g]):sum(sizes[:g]) + n])
        assert xp[st + n:st + padded[g]].eq(0).all()
    assert torch.equal(layout.gather(xp), x)
    xb = layout.batched(x)  # [G, R, 3]: the reference paths' view of the same groups
    assert xb.shape == (len(sizes), _ru(max(sizes), 32), 3)
    for g, n in enumerate(sizes):
        assert torch.equal(xb[g, :n], x[sum(sizes[:g]):sum(sizes[:g]) + n])
        assert xb[g, n:].eq(0).all()
    assert torch.equal(layout.unbatch(xb), x)

    cols = 5  # groups along rows: each group's [padded_g, cols] scales blocked on their own
    rs = torch.randint(0, 255, (layout.capacity, cols), dtype=torch.uint8)
    got = mx_native.row_group_scales(layout, rs.view(E8M0)).view(torch.uint8).reshape(-1)
    want = torch.cat([to_blocked(rs[st:st + p]) for st, p in zip(starts, padded)])
    assert torch.equal(got[:want.numel()], want) and got[want.numel():].eq(0).all()

    rows = 130  # groups along the contraction: each group's [rows, padded_g/32] block
    cs = torch.randint(0, 255, (rows, layout.capacity // 32), dtype=torch.uint8)
    got = mx_native.col_group_scales(layout, cs.view(E8M0)).view(torch.uint8).reshape(-1)
    want = torch.cat([to_blocked(cs[:, st // 32:(st + p) // 32]) for st, p in zip(starts, padded)])
    assert torch.equal(got[:want.numel()], want) and got[want.numel():].eq(0).all()


def _bf16_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Native outputs are bf16-rounded products of the same MX operands as the emulation."""
    scale = b.abs().amax().clamp_min(1e-30)
    assert ((a.double() - b.double()).abs() / scale).max() < 8e-3
    assert ((a.double() - b.double()).norm() / b.double().norm()) < 4e-3


def _grads(fn, *inputs, dy):
    leaves = [t.clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("wgrad_hp", [False, True])
def test_native_linear_reproduces_emulation(native, wgrad_hp, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 50, 96, generator=g), torch.randn(40, 96, generator=g) / 10
    dy = torch.randn(3, 50, 40, generator=g)

    def run():
        return _grads(lambda a, b: mxl.mx_linear(a, b, wgrad_hp=wgrad_hp), x, w, dy=dy)

    got = run()
    monkeypatch.setenv("K3_MX_BACKEND", "emulated")
    mxl._backend_for.cache_clear()
    want = run()
    for a, b in zip(got, want):
        _bf16_close(a, b)


@pytest.mark.parametrize("wgrad_hp", [False, True])
def test_native_grouped_reproduces_emulation(native, wgrad_hp, monkeypatch):
    g = torch.Generator().manual_seed(1)
    sizes = torch.tensor([37, 0, 64, 3, 96])  # unaligned, empty and aligned groups
    x = torch.randn(int(sizes.sum()), 64, generator=g)
    w = torch.randn(len(sizes), 48, 64, generator=g) / 8
    dy = torch.randn(x.shape[0], 48, generator=g)

    def run():
        return _grads(lambda a, b: mxl.mx_grouped_mm(a, b, sizes, wgrad_hp=wgrad_hp), x, w, dy=dy)

    got = run()
    assert not any(t.isnan().any() for t in got), "read rows outside the groups"
    monkeypatch.setenv("K3_MX_BACKEND", "emulated")
    mxl._backend_for.cache_clear()
    want = run()
    for a, b in zip(got, want):
        _bf16_close(a, b)
    assert got[2][1].eq(0).all()  # the empty expert gets no gradient


def test_native_wgrad_blocks_start_at_each_group(native):
    """A group boundary inside a 32-token block would mix two experts' scales: the emulator's
    per-group contraction would then disagree with globally blocked tokens."""
    g = torch.Generator().manual_seed(2)
    sizes = torch.tensor([5, 64])
    dy = torch.randn(69, 32, generator=g)
    x = torch.randn(69, 32, generator=g)
    dy[:5] *= 1e3  # expert 0's large gradients would dominate expert 1's first block
    layout = TokenGroups(sizes, 69)
    dw = mx_native.native_grouped_wgrad(layout.scatter(dy), layout.scatter(x), layout, "rceil")
    ref = dy[5:].double().T @ x[5:].double()
    assert ((dw[1].double() - ref).norm() / ref.norm()) < 0.08


def test_forced_backend_is_validated(monkeypatch):
    monkeypatch.setenv("K3_MX_BACKEND", "fast")
    mxl._backend_for.cache_clear()
    with pytest.raises(ValueError, match="K3_MX_BACKEND"):
        mxl.mx_backend("cpu")
    mxl._backend_for.cache_clear()


def test_quantised_operands_are_e4m3_with_padded_rows():
    """The dense native operands: C padded to 32, rows to 128, quantised along C."""
    a = torch.randn(70, 40)
    q, s = mx_native._quantize_rows(a, "rceil", 128)
    assert q.shape == (128, 64) and s.shape == (128, 2) and q.dtype == E4M3
    ref_q, ref_s = mx_quantize(torch.nn.functional.pad(a, (0, 24, 0, 58)))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), ref_s.view(torch.uint8))


@pytest.mark.parametrize("grouped", [False, True])
def test_probe_accepts_kernels_that_agree_and_refuses_others(native, monkeypatch, grouped):
    """The one-time probe that lets a real SM100 kernel take over: it must pass on kernels that
    honour the contract, and refuse (leaving the emulation) kernels that fail or are wrong."""
    assert mxl.probe_native("cpu", grouped) == ""
    name, good = (("scaled_grouped_mm", fake_scaled_grouped_mm) if grouped
                  else ("_scaled_mm", fake_scaled_mm))
    owner = F if grouped else torch

    def transposed_scales(*args, **kw):  # a kernel reading the scales in another order
        args = list(args)
        i = 2
        flat = args[i].view(torch.uint8).reshape(-1)
        args[i] = flat.flip(0).view(E8M0).reshape(args[i].shape)
        return good(*args, **kw)

    def missing(*args, **kw):
        raise RuntimeError("not compiled with FBGEMM GenAI")

    monkeypatch.setattr(owner, name, transposed_scales)
    assert "disagrees" in mxl.probe_native("cpu", grouped)
    monkeypatch.setattr(owner, name, missing)
    assert "RuntimeError" in mxl.probe_native("cpu", grouped)
