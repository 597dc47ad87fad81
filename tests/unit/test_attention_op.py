"""Packed causal attention against a per-document float64 oracle; no O(T^2) tensor in traces."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import model.ops.attention as attn
from model.mla import GatedMLA
from model.ops.backends import force_cuda_backends
from model.packing import Packing
from tests.helpers.tiny import debug_config

T = 80
DOC_LENS = [[1, 37, 5, 1, 36], [80]]  # row 0 cuts blocks of 16 mid-document; one-token docs
TRAILING_EMPTY = 3  # cu_seqlens ends in empty documents (repeats of B*T)
H, DQK, DV = 3, 12, 8


def _cu_seqlens() -> torch.Tensor:
    ends = torch.tensor([n for row in DOC_LENS for n in row]).cumsum(0)
    return torch.cat([torch.zeros(1, dtype=torch.long), ends,
                      ends[-1:].repeat(TRAILING_EMPTY)]).to(torch.int32)


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(DOC_LENS)
    q, k = (torch.randn(B, T, H, DQK, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, DV, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def oracle(q, k, v, cu_seqlens, scale):
    """Python loop over documents, explicit float64 softmax: [N, H, D] tokens -> [N, H, Dv]."""
    qf, kf, vf = (x.double().reshape(-1, *x.shape[-2:]) for x in (q, k, v))
    outs = []
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        s = torch.einsum("ihd,jhd->hij", qf[a:b], kf[a:b]) * scale  # [H, n, n]
        keep = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        p = p / p.sum(-1, keepdim=True)
        outs.append(torch.einsum("hij,jhd->ihd", p, vf[a:b]))  # [n, H, Dv]
    return torch.cat(outs).view(*v.shape[:-1], v.shape[-1])


def oracle_lse(q, k, cu_seqlens, scale):
    """Log-sum-exp of the causal in-document scores: [N, H, D] -> [H, N]."""
    out = torch.empty(q.shape[1], q.shape[0], dtype=torch.float64)
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            s = torch.einsum("ihd,jhd->hij", q[a:b].double(), k[a:b].double()) * scale
            s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
            out[:, a:b] = torch.logsumexp(s, -1)
    return out


def _check_against_oracle(fn, dtype=torch.float64, tol=1e-10):
    q, k, v = _inputs(dtype)
    cu = _cu_seqlens()
    packing = Packing(len(DOC_LENS), T, "cpu", cu, max(max(r) for r in DOC_LENS))
    scale = DQK ** -0.5 * 1.3
    got = fn(q, k, v, packing, scale)
    assert got.shape == v.shape and got.dtype == dtype
    dout = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    ref = oracle(q, k, v, cu, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), rtol=tol, atol=tol)


def test_blockwise_matches_oracle_forward_and_backward(monkeypatch):
    _check_against_oracle(lambda *a: attn.blockwise_attention(*a, block_q=16))
    monkeypatch.setenv("K3_ATTN_BACKEND", "blockwise")
    _check_against_oracle(attn.packed_causal_attention)  # default block: one block of 80
    _check_against_oracle(lambda *a: attn.blockwise_attention(*a, block_q=32),
                          dtype=torch.float32, tol=2e-5)


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("K3_ATTN_BACKEND", raising=False)
    assert attn.attention_backend("cpu", torch.bfloat16) == "blockwise"
    with force_cuda_backends():
        assert attn.attention_backend("cpu", torch.float32) == "varlen"
    monkeypatch.setenv("K3_ATTN_BACKEND", "blockwise")
    with force_cuda_backends():
        assert attn.attention_backend("cpu", torch.float32) == "blockwise"
    monkeypatch.setenv("K3_ATTN_BACKEND", "flash")
    with pytest.raises(ValueError, match="K3_ATTN_BACKEND"):
        attn.attention_backend("cpu", torch.float32)


# ----------------------------------------------------------------------------- varlen stand-ins
CALLS: list[str] = []


def _check_kernel_args(q, k, v, cu_q, cu_k, max_q, max_k):
    N = len(DOC_LENS) * T
    assert q.shape == k.shape == v.shape == (N, H, DQK)  # flattened; v padded to Dqk
    assert all(x.is_contiguous() for x in (q, k, v))
    assert torch.equal(v[..., DV:], torch.zeros_like(v[..., DV:]))
    assert cu_q.dtype == torch.int32 and cu_k is cu_q and torch.equal(cu_q, _cu_seqlens())
    assert max_q == max_k == 80 and isinstance(max_q, int)


def _kernel_scale(scale, d):
    return d ** -0.5 if scale is None else scale


def varlen_attn_window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                       return_aux=None, scale=None, window_size=(-1, -1)):
    """Stand-in for torch >= 2.11's varlen_attn: causal is window_size=(-1, 0)."""
    _check_kernel_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    assert tuple(window_size) == (-1, 0) and return_aux.lse and scale is not None
    CALLS.append("fwd")
    s = _kernel_scale(scale, query.shape[-1])
    return (oracle(query, key, value, cu_seq_q, s).to(query.dtype),
            oracle_lse(query, key, cu_seq_q, s).float())


def varlen_attn_is_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                          is_causal=False, return_aux=None):
    """Stand-in for torch 2.10's varlen_attn: is_causal flag, no scale (kernel uses D^-1/2)."""
    _check_kernel_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    assert is_causal is True and return_aux.lse
    CALLS.append("fwd")
    s = _kernel_scale(None, query.shape[-1])
    return (oracle(query, key, value, cu_seq_q, s).to(query.dtype),
            oracle_lse(query, key, cu_seq_q, s).float())


def _oracle_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
                     is_causal, rng_state, scale):
    """Attention's gradient formula per document in float64 (autograd is off inside an op)."""
    _check_kernel_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    assert is_causal and rng_state.dtype == torch.uint64 and grad_out.shape == query.shape
    s = _kernel_scale(scale, query.shape[-1])
    torch.testing.assert_close(out.double(), oracle(query, key, value, cu_seq_q, s))  # padded
    torch.testing.assert_close(lse.double(), oracle_lse(query, key, cu_seq_q, s))
    q, k, v, do = (t.double() for t in (query, key, value, grad_out))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cu = cu_seq_q.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        sc = torch.einsum("ihd,jhd->hij", q[a:b], k[a:b]) * s  # [H, n, n]
        sc = sc.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
        p = torch.softmax(sc, -1)
        dv[a:b] = torch.einsum("hij,ihd->jhd", p, do[a:b])
        dp = torch.einsum("ihd,jhd->hij", do[a:b], v[a:b])
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[a:b] = torch.einsum("hij,jhd->ihd", ds, k[a:b]) * s
        dk[a:b] = torch.einsum("hij,ihd->jhd", ds, q[a:b]) * s
    CALLS.append("bwd")
    return tuple(g.to(query.dtype) for g in (dq, dk, dv))


# Same schemas as torch_attn::_varlen_attn_backward (torch >= 2.11, and 2.10).
@torch.library.custom_op("k3test::varlen_bwd_window", mutates_args=())
def varlen_bwd_window(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int,
                      is_causal: bool, rng_state: torch.Tensor, scale: float | None = None,
                      window_size: list[int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert window_size == [-1, 0] and scale is not None
    return _oracle_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q,
                            max_k, is_causal, rng_state, scale)


@torch.library.custom_op("k3test::varlen_bwd_is_causal", mutates_args=())
def varlen_bwd_is_causal(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int,
                         is_causal: bool, rng_state: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _oracle_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q,
                            max_k, is_causal, rng_state, None)


@pytest.mark.parametrize("form", ["window_size", "is_causal"])
def test_varlen_custom_op_calls_kernel_as_documented(monkeypatch, form):
    fwd, bwd = {"window_size": (varlen_attn_window, torch.ops.k3test.varlen_bwd_window),
                "is_causal": (varlen_attn_is_causal, torch.ops.k3test.varlen_bwd_is_causal)}[form]
    monkeypatch.setattr(attn, "_varlen_forward_fn", lambda: fwd)
    monkeypatch.setattr(attn, "_varlen_backward_op", lambda: bwd)
    CALLS.clear()
    with force_cuda_backends():
        _check_against_oracle(attn.packed_causal_attention)
    assert CALLS == ["fwd", "bwd"]


def test_installed_torch_varlen_form():
    """torch 2.13 (this machine): window_size and scale; its backward op is registered."""
    fn = attn._varlen_forward_fn()
    assert fn is not None and attn._call_form(fn) == attn._CallForm(window_size=True, scale=True)
    names = [a.name for a in attn._varlen_backward_op().default._schema.arguments]
    assert names[:12] == ["grad_out", "query", "key", "value", "out", "lse", "cu_seq_q",
                          "cu_seq_k", "max_q", "max_k", "is_causal", "rng_state"]


# ----------------------------------------------------------------------------- memory traces
class LargestOutput(TorchDispatchMode):
    """Records the largest output numel of any op, and which ops ran."""

    def __init__(self):
        super().__init__()
        self.largest, self.worst, self.ops = 0, None, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor) and o.numel() > self.largest:
                self.largest, self.worst = o.numel(), str(func)
        return out


def _trace_mla(seq, docs):
    """Fake-tensor forward + backward of one debug GatedMLA layer, B=1, `docs` equal documents."""
    cfg = debug_config()
    mla = GatedMLA(cfg, device=torch.device("meta"))
    cu = torch.arange(0, seq + 1, seq // docs, dtype=torch.int32)
    with FakeTensorMode(allow_non_fake_inputs=True):
        mla = mla.to_empty(device="cpu")
        x = torch.randn(1, seq, cfg.hidden_size, requires_grad=True)
        packing = Packing(1, seq, "cpu", cu, seq // docs)
        with LargestOutput() as rec:
            mla(x, packing).sum().backward()
        assert x.grad is not None and mla.q_b_proj.weight.grad is not None
    return rec


def test_varlen_trace_at_64k_has_no_quadratic_tensor():
    seq = 65_536
    with force_cuda_backends():
        rec = _trace_mla(seq, docs=8)
    assert {"k3.varlen_attention.default", "k3.varlen_attention_backward.default"} <= rec.ops
    assert rec.largest < seq * seq // 64, (rec.largest, rec.worst)


def test_blockwise_trace_has_no_quadratic_tensor(monkeypatch):
    """Largest tensor: the [B, 1, BLOCK_Q, T] block mask = T^2 / 16 at T = 4096."""
    monkeypatch.delenv("K3_ATTN_BACKEND", raising=False)
    seq = 4096
    rec = _trace_mla(seq, docs=4)
    assert not any("varlen" in op for op in rec.ops)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in rec.ops  # fused kernel
    assert rec.largest <= attn.BLOCK_Q * seq < seq * seq // 8, (rec.largest, rec.worst)
