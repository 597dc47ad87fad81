"""MXFP8 quantiser (bit-exact vs a float64 OCP MX v1.0 oracle) and the MXFP8 GEMMs' axes."""

import logging
import math

import pytest
import torch

from model.ops import mx_linear as mxl
from model.ops.mx import fake_quantize_mx, mx_dequantize, mx_quantize, pad_to_block
from model.ops.mx_linear import mx_backend, mx_grouped_mm, mx_linear

INF, NAN = float("inf"), float("nan")


# ---- independent oracle: plain Python float64, one block of 32 at a time ----
def _oracle_exp(amax: float, mode: str) -> int:
    """Scale exponent for finite amax > 0, found by exact search on powers of two."""
    if mode == "rceil":  # smallest e with amax / 2^e <= 448
        e = math.ceil(math.log2(amax / 448.0))
        while amax / 2.0**e > 448.0:
            e += 1
        while amax / 2.0 ** (e - 1) <= 448.0:
            e -= 1
    else:  # floor(log2 amax) - 8
        e = math.floor(math.log2(amax))
        while 2.0**e > amax:
            e -= 1
        while 2.0 ** (e + 1) <= amax:
            e += 1
        e -= 8
    return max(-127, min(127, e))


def _e4m3_byte(v: float) -> int:
    """Saturating round-to-nearest-even encoding of float64 v into float8_e4m3fn bits."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 448.0)
    quantum = 2.0**-9 if a < 2.0**-6 else 2.0 ** (math.frexp(a)[1] - 1 - 3)
    q = round(a / quantum) * quantum  # Python round() ties to even
    if q < 2.0**-6:  # subnormal (mantissa count 8 is exactly the first normal, byte 0x08)
        return sign | int(q / 2.0**-9)
    E = math.frexp(q)[1] - 1
    return sign | (E + 7) << 3 | int(q / 2.0**E * 8 - 8)


def _oracle_block(block: list[float], mode: str) -> tuple[int, list[int]]:
    if any(math.isnan(v) for v in block):
        return 0xFF, [0x7F] * len(block)
    amax = max(abs(v) for v in block)
    e = 127 if amax == INF else -127 if amax == 0 else _oracle_exp(amax, mode)
    return e + 127, [_e4m3_byte(v / 2.0**e) for v in block]


def _decode(byte: int, scale_byte: int) -> float:
    """OCP value of an e4m3 element byte times its e8m0 scale, in float64."""
    if byte & 0x7F == 0x7F or scale_byte == 0xFF:
        return NAN
    E, m = byte >> 3 & 0xF, byte & 7
    v = m * 2.0**-9 if E == 0 else (1 + m / 8) * 2.0 ** (E - 7)
    return (-v if byte & 0x80 else v) * 2.0 ** (scale_byte - 127)


def _check_against_oracle(x: torch.Tensor, mode: str) -> None:
    """x: [B, 32] float32; compares every scale and data byte, and the dequantised values."""
    data, scale = mx_quantize(x, mode=mode)
    back = mx_dequantize(data, scale, dtype=torch.float64)
    for b, row in enumerate(x.double().tolist()):
        s, d = _oracle_block(row, mode)
        assert scale.view(torch.uint8)[b].item() == s, (mode, b, row)
        assert data.view(torch.uint8)[b].tolist() == d, (mode, b, row)
        expect = torch.tensor([_decode(q, s) for q in d], dtype=torch.float64)
        torch.testing.assert_close(back[b], expect, rtol=0, atol=0, equal_nan=True)


def _block(*vals: float, fill: float = 0.0) -> list[float]:
    return list(vals) + [fill] * (32 - len(vals))


# fp32 neighbour above 448*2^40: ceil(log2(amax / 448)) evaluated in float32 rounds to 40
NEXT_UP = torch.nextafter(torch.tensor(448.0 * 2**40), torch.tensor(INF)).item()
CRAFTED = torch.tensor([
    _block(),                                                     # all zero
    _block(-0.0, 0.0, -0.0),                                      # signed zeros
    _block(1.0, NAN, -3.0),                                       # NaN block
    _block(INF, -INF, 3e38, 1.0, -2.0**-100),                     # Inf block
    _block(-INF, 5.0),                                            # Inf block, negative
    _block(448.0 * 8, 1.0, -3.3, 7.7),                            # amax exactly 448*2^3
    _block(32.0, -31.0, 0.1),                                     # amax exactly 2^5
    _block(-2.0**-3, 2.0**-4 * 1.5, 0.01),                        # amax power of two, negative
    _block(1e-40, -3e-41, 1e-45),                                 # subnormal amax
    _block(float(torch.finfo(torch.float32).smallest_normal)),
    _block(449.0 * 16, 460.0 * 16, -500.0 * 16, 440 * 16),        # FLOOR saturates, RCEIL not
    _block(-449.0 * 2.0**-20, 300.0 * 2.0**-20),
    _block(NEXT_UP, 448.0 * 2**40, -1.0),
    _block(448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10,
           15 * 2.0**-10, 17.0, 19.0, 432.0, -432.0),             # RNE ties at scale 2^0
    _block(3e38, -2e38, 1.0),                                     # near float32 max
    _block(fill=-7.25),                                           # constant negative
], dtype=torch.float32)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_crafted_blocks_bit_exact(mode):
    _check_against_oracle(CRAFTED, mode)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_random_blocks_bit_exact(mode):
    g = torch.Generator().manual_seed(0)
    mags = torch.pow(10.0, torch.randint(-42, 38, (48, 1), generator=g).float())
    x = (torch.randn(48, 32, generator=g) * mags).float()
    x[::5, 3] = 0.0
    _check_against_oracle(x, mode)


def test_special_values_and_modes():
    data, scale = mx_quantize(CRAFTED)
    s, d = scale.view(torch.uint8), data.view(torch.uint8)
    assert s[0] == 0 and d[0].eq(0).all() and d[1, :3].tolist() == [0x80, 0, 0x80]
    assert s[2] == 0xFF and d[2].eq(0x7F).all()
    assert s[3] == 0xFE and d[3, :2].tolist() == [0x7E, 0xFE] and s[4] == 0xFE
    assert s[5] == 127 + 3 and d[5, 0] == 0x7E  # 448*2^3 -> 2^3, not 2^4
    assert s[6] == 127 - 3  # 32 / 2^-3 = 256 <= 448 < 512
    assert s[8] == 0 and d[8, 0] != 0  # subnormal amax: scale clamps at 2^-127, data survives
    assert s[12] == 127 + 41 and d[12, :2].tolist() == [0x76, 0x76]  # one ulp above: 2^41
    naive = torch.ceil(torch.log2(CRAFTED[12].abs().amax() / 448.0))  # torchao-style float math
    assert naive == 40  # ... would have picked 2^40 and saturated the block max
    floor_data, floor_scale = mx_quantize(CRAFTED, mode="floor")
    assert floor_scale.view(torch.uint8)[10] == 127 + 4 and s[10] == 127 + 5
    assert floor_data.view(torch.uint8)[10, :3].tolist() == [0x7E, 0x7E, 0xFE]  # saturated
    assert d[10, :3].tolist() != [0x7E, 0x7E, 0xFE]
    back = mx_dequantize(data, scale)
    assert back[2].isnan().all() and back[3, :2].tolist() == [INF, -INF]
    assert back[5, 0] == 3584.0 and back[0].eq(0).all()


def test_dim_bf16_errors_padding_and_fake_quant():
    x = torch.randn(64, 32) * torch.logspace(-3, 3, 32)
    d0, s0 = mx_quantize(x, dim=0)
    d1, s1 = mx_quantize(x.T.contiguous(), dim=-1)
    assert s0.shape == (2, 32) and d0.shape == (64, 32)
    assert torch.equal(d0.view(torch.uint8), d1.view(torch.uint8).T)
    assert torch.equal(s0.view(torch.uint8), s1.view(torch.uint8).T)
    xb = torch.randn(3, 64).bfloat16()
    assert torch.equal(mx_quantize(xb)[0].view(torch.uint8),
                       mx_quantize(xb.float())[0].view(torch.uint8))
    assert fake_quantize_mx(xb).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\(4, 40\).*pad_to_block"):
        mx_quantize(torch.randn(4, 40))
    padded, n = pad_to_block(torch.randn(4, 40), dim=1)
    assert padded.shape == (4, 64) and n == 40 and padded[:, 40:].eq(0).all()
    fq = fake_quantize_mx(x, dim=0)
    assert torch.equal(fake_quantize_mx(fq, dim=0), fq)  # idempotent
    assert torch.equal(fq, mx_dequantize(d0, s0, dim=0))
    xr = x.clone().requires_grad_()
    fake_quantize_mx(xr).sum().backward()  # straight-through gradient
    assert torch.equal(xr.grad, torch.ones_like(x))


def test_backend_is_emulated_on_cpu_and_logged_once(caplog):
    mxl._backend_for.cache_clear()
    with caplog.at_level(logging.INFO, logger="k3train.mx"):
        assert mx_backend("cpu") == "emulated" and mx_backend(torch.device("cpu")) == "emulated"
    assert len([r for r in caplog.records if "emulated" in r.getMessage()]) == 1


# ---- GEMM axes ----
def fq(t, dim):
    return fake_quantize_mx(t, dim=dim)


def _run_linear(x, w, dy, **kw):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = mx_linear(x, w, **kw)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _rel_elem(a, b):
    return ((a - b).abs() / (b.abs() + 1)).max().item()


def test_each_gemm_quantises_along_its_contraction_axis():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, 64, generator=g)  # M = 64 tokens, K = 64
    w = torch.randn(96, 64, generator=g)  # N = 96
    dy = torch.randn(2, 32, 96, generator=g)
    x[0, 0, 0], w[0, 0], dy[0, 5, 7] = 1e6, 1e6, -1e6  # outliers wipe out their block's peers
    y, dx, dw = _run_linear(x, w, dy)
    X, dY = x.reshape(64, 64), dy.reshape(64, 96)
    cases = {  # name: (actual, correct reference, wrong-axis references)
        "fprop": (y.reshape(64, 96), fq(X, 1) @ fq(w, 1).T,
                  [fq(X, 0) @ fq(w, 1).T, fq(X, 1) @ fq(w, 0).T]),
        "dgrad": (dx.reshape(64, 64), fq(dY, 1) @ fq(w, 0),
                  [fq(dY, 0) @ fq(w, 0), fq(dY, 1) @ fq(w, 1)]),
        "wgrad": (dw, fq(dY, 0).T @ fq(X, 0),
                  [fq(dY, 1).T @ fq(X, 0), fq(dY, 0).T @ fq(X, 1)]),
    }
    for name, (actual, ref, wrongs) in cases.items():
        torch.testing.assert_close(actual, ref, rtol=1e-5, atol=1e-4, msg=name)
        for wrong in wrongs:
            assert _rel_elem(wrong, ref) > 0.1, name


def test_linear_error_bounds_and_wgrad_hp():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 48, 96, generator=g)
    w = torch.randn(80, 96, generator=g) / 96**0.5
    dy = torch.randn(4, 48, 80, generator=g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr @ wr.T).backward(dy)
    exact = ((x @ w.T), xr.grad, wr.grad)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    errs = [rel(a, b) for a, b in zip(_run_linear(x, w, dy), exact)]
    assert all(1e-3 < e < 0.05 for e in errs), errs
    _, dx_hp, dw_hp = _run_linear(x, w, dy, wgrad_hp=True)
    assert rel(dw_hp, exact[2]) < 1e-5 < errs[2]  # dY is the true gradient: wgrad is exact
    assert rel(dx_hp, exact[1]) == errs[1]
    for mode in ("rceil", "floor"):
        yb = mx_linear(x.bfloat16(), w.bfloat16(), mode=mode)
        assert yb.dtype == torch.bfloat16 and rel(yb.float(), exact[0]) < 0.05


def test_linear_unaligned_sizes_equal_zero_padded_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 40, generator=g)  # M = 35, K = 40
    w = torch.randn(50, 40, generator=g)  # N = 50
    dy = torch.randn(5, 7, 50, generator=g)
    x[0, 0, 1], dy[1, 2, 3] = 300.0, 90.0
    y, dx, dw = _run_linear(x, w, dy)
    Xp = torch.zeros(64, 64)
    Xp[:35, :40] = x.reshape(35, 40)
    Wp = torch.zeros(64, 64)
    Wp[:50, :40] = w
    dYp = torch.zeros(64, 64)
    dYp[:35, :50] = dy.reshape(35, 50)
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.reshape(35, 50), (fq(Xp, 1) @ fq(Wp, 1).T)[:35, :50], **close)
    torch.testing.assert_close(dx.reshape(35, 40), (fq(dYp, 1) @ fq(Wp, 0))[:35, :40], **close)
    torch.testing.assert_close(dw, (fq(dYp, 0).T @ fq(Xp, 0))[:50, :40], **close)


@pytest.mark.parametrize("wgrad_hp", [False, True])
def test_grouped_equals_per_group_linear(wgrad_hp):
    g = torch.Generator().manual_seed(4)
    sizes = [0, 5, 64, 37]
    S, K, N = sum(sizes), 40, 48
    x = torch.randn(S, K, generator=g)
    w = torch.randn(len(sizes), N, K, generator=g)
    dy = torch.randn(S, N, generator=g)
    x[5, 0], x[40, 3] = 1e5, -2e4  # group 2's rows start at 5: per-group token blocks matter
    dy[5], dy[40] = 0.0, 0.0  # outliers set their blocks' scales but add nothing to dW
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = mx_grouped_mm(xr, wr, torch.tensor(sizes), wgrad_hp=wgrad_hp)
    y.backward(dy)
    ys, dxs, dws, start = [], [], [], 0
    for i, n in enumerate(sizes):
        sl = slice(start, start + n)
        yi, dxi, dwi = _run_linear(x[sl], w[i], dy[sl], wgrad_hp=wgrad_hp)
        ys.append(yi)
        dxs.append(dxi)
        dws.append(dwi if dwi is not None else torch.zeros(N, K))
        start += n
    close = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y.detach(), torch.cat(ys), **close)
    torch.testing.assert_close(xr.grad, torch.cat(dxs), **close)
    torch.testing.assert_close(wr.grad, torch.stack(dws), **close)
    assert wr.grad[0].eq(0).all()
    if not wgrad_hp:  # blocking tokens globally (ignoring group starts) gives another answer
        xg = fq(pad_to_block(x, dim=0)[0], 0)[5:69]
        dyg = fq(pad_to_block(dy, dim=0)[0], 0)[5:69]
        assert _rel_elem(dyg.T @ xg, wr.grad[2]) > 0.1


def test_single_nt_primitive_reproduces_each_gemm_axis():
    """fprop/dgrad/wgrad all go through _mm_nt(a, b): check it equals the explicit axis forms."""
    from model.ops.mx_linear import _fq, _mm_nt

    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((64, 96), (32, 96), (64, 32)))
    torch.testing.assert_close(_mm_nt(x, w, "rceil"), _fq(x, -1, "rceil") @ _fq(w, -1, "rceil").T)
    torch.testing.assert_close(_mm_nt(dy, w.T, "rceil"), _fq(dy, -1, "rceil") @ _fq(w, 0, "rceil"))
    torch.testing.assert_close(_mm_nt(dy.T, x.T, "rceil"),
                               _fq(dy, 0, "rceil").T @ _fq(x, 0, "rceil"))


def test_mx_gemms_compile_like_eager():
    """Under torch.compile (aot_eager) both MX GEMMs give eager's values and gradients, and the
    backend choice is a trace-time constant (its logging would otherwise break the graph)."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 64, generator=g), torch.randn(48, 64, generator=g)
    wg, sizes = torch.randn(3, 48, 64, generator=g), torch.tensor([10, 0, 30])

    def f(x, w, wg):
        return mx_linear(x, w).square().sum() + mx_grouped_mm(x, wg, sizes).square().sum()

    torch._dynamo.reset()
    counters.clear()
    mxl._backend_for.cache_clear()
    outs = []
    for fn in (f, torch.compile(f, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (x, w, wg)]
        y = fn(*leaves)
        y.backward()
        outs.append([y.detach()] + [t.grad for t in leaves])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] > 0
    assert not any("logging" in reason for reason in counters["graph_break"])
    torch._dynamo.reset()
