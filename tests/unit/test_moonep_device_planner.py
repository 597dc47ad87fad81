"""Tests for moonep/device_planner.py and moonep/planner_triton.py: the sync-free planner.

* torch backend == `plan_replicas` bit for bit (alloc, replica_slots, rank_load) and ok is True,
  on ~1300 inputs over (E, R) in {8, 896} x {2, 4, 8, 64} (+ a few odd shapes): uniform, Zipf,
  tiny (ties), sparse, all on one expert, all on one home group, equal everywhere, one source,
  overshoot-forcing group patterns, all zero; R_src = R, 1 or R + 3;
* a plain-Python restatement of the two greedy state machines equals planner.py and never needs
  more steps than `greedy_steps` (the bound the fixed-count loops rely on);
* no host sync (`train.observe.host_syncs.HostSyncCounter` sees 0) and FakeTensorMode traces, on
fake CPU
  and fake CUDA tensors; ok is False for negative counts and for a corrupted alloc;
* op counts: fixed for a shape whatever the counts, <= 4*T2 + 6*T3 + 100 for torch;
* the Triton kernel under TRITON_INTERPRET=1 in a subprocess (the variable must be set before
  triton.jit runs) on 68 cases incl. E=896/R=64 and the adversarial kinds, with its op count;
  importing moonep does not import triton;
* the simulate CLI's new fields.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moonep import simulate as sim
from moonep.device_planner import (
    _finish,
    greedy_steps,
    plan_replicas_device,
    planner_launches,
)
from moonep.planner import plan_replicas, rank_targets
from train.observe.host_syncs import HostSyncCounter

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("uniform", "zipf", "tiny", "sparse", "one_expert", "one_group", "equal", "one_source",
         "overshoot", "zero")


def make_counts(kind: str, e: int, r: int, r_src: int, g: torch.Generator) -> torch.Tensor:
    """[r_src, e] int64 counts of one kind, generated directly (no token sampling)."""
    def rand(hi: int, shape=(r_src, e)) -> torch.Tensor:
        return torch.randint(0, hi, shape, generator=g)

    epn = e // r
    if kind == "uniform":
        return rand(int(rand(60, (1,))) + 1)
    if kind == "zipf":  # p ∝ 1/(z+1)^s over shuffled experts, ~n pairs per source, rounded
        s = 0.5 + 2.5 * float(torch.rand(1, generator=g))
        p = (torch.randperm(e, generator=g) + 1.0) ** -s
        n = torch.randint(0, 4000, (r_src, 1), generator=g).double()
        noise = torch.rand(r_src, e, generator=g, dtype=torch.float64)
        return (p / p.sum() * n + noise).floor().long()
    if kind == "tiny":
        return rand(3)
    if kind == "sparse":
        return rand(500) * (torch.rand(r_src, e, generator=g) < 0.1)
    out = torch.zeros(r_src, e, dtype=torch.int64)
    if kind == "one_expert":
        out[:, int(rand(e, (1,)))] = rand(300, (r_src,))
    elif kind == "one_group":
        h = int(rand(r, (1,)))
        out[:, h * epn:(h + 1) * epn] = rand(int(rand(40, (1,))) + 1, (r_src, epn))
    elif kind == "equal":  # one value on every expert of a random subset of groups: equal
        on = (torch.rand(r, generator=g) < 0.5).repeat_interleave(epn)  # donors, equal rooms,
        out[:, on] = int(rand(20, (1,))) + 1  # equal experts: ties in every argmax / argmin
    elif kind == "one_source":
        out[int(rand(r_src, (1,)))] = rand(200, (e,))
    elif kind == "overshoot":  # README's E=R=3 (4, 4, 1) pattern, tiled over groups and scaled
        pattern = torch.tensor([4, 4, 1])[torch.arange(r) % 3] * (int(rand(50, (1,))) + 1)
        hot = torch.randint(0, epn, (r,), generator=g) + torch.arange(r) * epn
        out[0, hot] = pattern  # one expert per group carries it (others maybe a little)
        out[-1] += rand(2, (e,)) * (torch.rand(e, generator=g) < 0.5)
    elif kind != "zero":
        raise ValueError(kind)
    return out


def cases(e: int, r: int, n: int, seed: int, kinds: tuple[str, ...] = KINDS
          ) -> list[tuple[str, torch.Tensor]]:
    """n (kind, counts) pairs cycling through kinds and R_src in (R, 1, R + 3)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        r_src = (r, 1, r + 3)[(i // len(kinds)) % 3]
        out.append((kind, make_counts(kind, e, r, r_src, g)))
    return out


def same_plan(counts: torch.Tensor, r: int, backend: str) -> tuple[bool, bool]:
    """(device plan == host plan bit for bit, ok) for one input."""
    host = plan_replicas(counts, r)
    dev, ok = plan_replicas_device(counts, r, backend)
    equal = all(getattr(dev, k).dtype == torch.int64 and torch.equal(getattr(host, k),
                                                                       getattr(dev, k))
                for k in ("alloc", "replica_slots", "rank_load"))
    return equal, bool(ok)


SHAPES = [(8, 2, 300), (8, 4, 300), (8, 8, 300), (896, 2, 40), (896, 4, 50), (896, 8, 60),
          (896, 64, 100), (3, 3, 60), (6, 3, 60), (12, 4, 60), (16, 16, 60), (1, 1, 10),
          (5, 1, 10)]


@pytest.mark.parametrize(("e", "r", "n"), SHAPES, ids=[f"E{e}R{r}" for e, r, _ in SHAPES])
def test_torch_backend_equals_host(e: int, r: int, n: int) -> None:
    bad = []
    for i, (kind, counts) in enumerate(cases(e, r, n, seed=1000 * e + r)):
        equal, ok = same_plan(counts, r, "torch")
        if not (equal and ok):
            bad.append((i, kind, tuple(counts.shape), equal, ok))
    assert not bad, bad


def reference_steps(counts: torch.Tensor, r: int) -> tuple[torch.Tensor, int, int]:
    """The two state machines as plain Python (the brief's restatement, not planner.py's heaps):
    (alloc, steps of step 2, most steps of one group in step 3)."""
    ec = counts.sum(0).tolist()
    e = len(ec)
    epn = e // r
    target = rank_targets(sum(ec), r).tolist()
    bal = [sum(ec[h * epn:(h + 1) * epn]) - target[h] for h in range(r)]
    z = [[0] * r for _ in range(r)]
    steps2 = 0
    while max(bal) > 0:
        h = bal.index(max(bal))  # first maximum = lowest index
        u = bal.index(min(bal))
        z[h][u] += -bal[u]
        bal[h] += bal[u]
        bal[u] = 0
        steps2 += 1
    alloc = [[0] * r for _ in range(e)]
    steps3 = 0
    for h in range(r):
        q, c, n = z[h][:], ec[h * epn:(h + 1) * epn], 0
        while max(q) > 0:
            u, j = q.index(max(q)), c.index(max(c))
            take = min(q[u], c[j])
            alloc[h * epn + j][u] += take
            q[u] -= take
            c[j] -= take
            n += 1
        for j in range(epn):
            alloc[h * epn + j][h] = c[j]
        steps3 = max(steps3, n)
    return torch.tensor(alloc, dtype=torch.int64), steps2, steps3


@pytest.mark.parametrize(("e", "r"), [(8, 2), (8, 4), (8, 8), (3, 3), (12, 4), (16, 16),
                                      (896, 64)])
def test_state_machines_and_step_bounds(e: int, r: int) -> None:
    t2, t3 = greedy_steps(e, r)
    assert (t2, t3) == (r - 1, r + e // r - 2)
    most = [0, 0]
    for kind, counts in cases(e, r, 30 if e == 896 else 200, seed=7 * e + r):
        alloc, s2, s3 = reference_steps(counts, r)
        assert torch.equal(alloc, plan_replicas(counts, r).alloc), kind
        assert s2 <= t2 and s3 <= t3, (kind, s2, s3, t2, t3)
        most = [max(most[0], s2), max(most[1], s3)]
    assert most[0] == t2  # step 2's bound is reached (one hot group fills every other rank)


def test_no_host_sync_and_fake_tensor_trace() -> None:
    counts = cases(896, 64, 2, seed=3)[1][1]
    with HostSyncCounter() as syncs:
        plan, ok = plan_replicas_device(counts, 64, "torch")
    assert syncs.total == 0, syncs.counts
    assert bool(ok) and plan.capacity is None and ok.dim() == 0 and ok.dtype == torch.bool
    # fake CUDA: every tensor is made on counts.device (a CPU one would raise); "auto" there is
    # the Triton custom op (its fake impl). Fake ops are slow, hence a smaller shape.
    runs = [("cpu", "torch"), ("cuda", "torch"), ("cuda", "auto")]
    for device, backend in runs:
        if backend == "auto":
            pytest.importorskip("triton")
        with FakeTensorMode():
            fake = torch.empty(8, 96, dtype=torch.int32, device=device)
            plan, ok = plan_replicas_device(fake, 8, backend)
            for t in (plan.alloc, plan.replica_slots, plan.rank_load):
                assert t.device.type == device and t.dtype == torch.int64
            assert plan.alloc.shape == (96, 8) and plan.replica_slots.shape == (8, 12)
            assert ok.shape == () and ok.device.type == device


def test_ok_flag_false_when_broken() -> None:
    counts = torch.tensor([[4, 4, 1]])
    _, ok = plan_replicas_device(counts, 3, "torch")
    assert bool(ok)
    _, ok = plan_replicas_device(torch.tensor([[4, -4, 1]]), 3, "torch")
    assert not bool(ok)  # plan_replicas raises ValueError on negative counts
    plan, _ = plan_replicas_device(counts, 3, "torch")
    ec = counts.sum(0)
    total = ec.sum()
    target = rank_targets(int(total), 3)
    donor = torch.tensor([1, -1, 0])  # README plan: rank 0 fills rank 2, rank 1 fills rank 0
    assert torch.equal(plan.alloc, torch.tensor([[2, 0, 2], [1, 3, 0], [0, 0, 1]]))
    _, ok = _finish(plan.alloc.clone(), donor, ec, total, target, counts, 3)
    assert bool(ok)
    for corrupt in ("move", "lose", "foreign"):
        alloc = plan.alloc.clone()
        if corrupt == "move":  # a pair to the wrong rank: loads differ from targets
            alloc[0, 0] -= 1
            alloc[0, 1] += 1
        elif corrupt == "lose":  # not conserved
            alloc[1, 1] -= 1
        else:  # rank 2 takes a pair of expert 1 (not from its donor group 0): slots not exact
            alloc[1, 1] -= 1
            alloc[1, 2] += 1
            alloc[0, 2] -= 1
            alloc[0, 0] += 1
        assert not bool(_finish(alloc, donor, ec, total, target, counts, 3)[1]), corrupt


def test_validation_errors() -> None:
    good = torch.zeros(2, 8, dtype=torch.int64)
    for bad, arg in [((torch.zeros(2, 8), 4), "counts"), ((torch.zeros(8, dtype=torch.int64), 4),
                     "counts"), ((good.bool(), 4), "counts"), ((good, 3), "num_ranks"),
                     ((good, 0), "num_ranks"), ((torch.zeros(2, 0, dtype=torch.int64), 1),
                     "num_ranks")]:
        with pytest.raises(ValueError, match=arg):
            plan_replicas_device(*bad)
    with pytest.raises(ValueError, match="backend"):
        plan_replicas_device(good, 4, "cuda")
    plan, ok = plan_replicas_device(good.to(torch.int16), 4)  # any integer dtype; auto on CPU
    assert bool(ok) and plan.alloc.dtype == torch.int64 and int(plan.alloc.abs().sum()) == 0


def test_op_count_fixed_and_bounded() -> None:
    for e, r in [(8, 2), (896, 8), (896, 64)]:
        t2, t3 = greedy_steps(e, r)
        ops = {planner_launches(c, r, "torch") for _, c in cases(e, r, 10, seed=5)}
        assert len(ops) == 1, ops  # no data-dependent op counts
        assert ops.pop() <= 4 * t2 + 6 * t3 + 100
    assert planner_launches(cases(8, 2, 1, 0)[0][1], 2, "torch", views=True) > \
        planner_launches(cases(8, 2, 1, 0)[0][1], 2, "torch")


_TRITON_SCRIPT = r"""
import json, sys
import moonep, moonep.device_planner  # noqa: F401
assert "triton" not in sys.modules, "importing moonep imported triton"
import torch
from moonep.device_planner import greedy_steps, planner_launches
from tests.unit.test_moonep_device_planner import cases, same_plan
import tests.unit.test_moonep_device_planner as tests
hard = ("overshoot", "equal", "one_group", "zipf")  # E=896 calls take ~1 s interpreted
shapes = [(8, 2, 14), (8, 4, 14), (8, 8, 14), (3, 3, 10), (12, 4, 10), (896, 8, 2), (896, 64, 4)]
n, bad, launches = 0, [], {}
for e, r, k in shapes:
    kinds = hard if e == 896 else tests.KINDS
    for kind, counts in cases(e, r, k, seed=99 * e + r, kinds=kinds):
        equal, ok = same_plan(counts, r, "triton")
        n += 1
        if not (equal and ok):
            bad.append([e, r, kind, equal, ok])
    launches[f"{e},{r}"] = planner_launches(counts, r, "triton")
print(json.dumps({"n": n, "bad": bad, "launches": launches}))
"""


def test_triton_kernel_interpreted() -> None:
    pytest.importorskip("triton", reason="triton not installed: the Triton backend is untested")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["n"] >= 60 and not out["bad"], out
    # kernel + fixed epilogue: the same small count for every shape (torch needs ~800 at R=64)
    assert len(set(out["launches"].values())) == 1 and out["launches"]["896,64"] <= 60, out


def test_simulate_reports_device_planner(capsys: pytest.CaptureFixture[str]) -> None:
    sim.main(["--experts", "32", "--topk", "4", "--ranks", "4", "--tokens-per-rank", "64",
              "--skew", "1.5", "--seed", "1", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip())
    assert out["device_equals_host"] is True
    assert out["plan_ms_host"] == out["planner_ms"] and out["plan_ms_device"] > 0
    t2, t3 = greedy_steps(32, 4)
    assert 4 * t2 + 6 * t3 <= out["plan_ops_device"] <= 4 * t2 + 6 * t3 + 100
