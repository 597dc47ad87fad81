"""The compiled step for the roofline: decoder layers as inductor would fuse them on a GPU.

`python benchmarks/roofline.py ... --compiled` predicts `parallel.compile=true`: every decoder
layer (`K3Model.decoder_layers()`, the MTP layer included) goes through `apply_compile`, as the
trainer does, but with `CompiledRegions.backend` in place of inductor's. That backend runs
inductor's own pipeline (`compile_fx`: decompositions, joint-graph passes, the min-cut
partition into forward and backward graphs, post-grad passes, lowering, and the scheduler's
fusion) and stops each graph before code generation. The traced tensors are CPU-device fakes,
so `config.cpu_backend="triton"` makes the scheduler fuse with the Triton backend's rules, the
ones it applies to CUDA tensors. Nothing is compiled to machine code; no GPU is needed.

Each scheduler node that is not an extern kernel or a no-op is one Triton kernel: it becomes
one `OpRecord` named `inductor.pointwise` or `inductor.reduction`, with inductor's own byte
count (`get_read_write_buffers_sizes()`: the buffers the fused kernel reads and writes), one
vector FLOP per element of each fused node, and the category most of its origin FX nodes have
(their source line in model/, through the roofline's file rules). Extern kernels (GEMMs, our
`k3::` custom ops, inductor's fallbacks such as `topk` and `sort`) keep the records the eager
roofline gives them: the partitioned graph also runs for real on the fake tensors under the
recorder, ops categorised from each FX node's source line; there every record of a GEMM,
attention, KDA or `k3::` op stays, as do the ops inside a `k3::` op the recorder expands; an
aten op stays only while inductor's extern kernels of that graph still have one of its name
(multiset matching); the rest is what the fused kernels replace. Extern kernels that matched
no record are reported (`unmatched_externs`: empty means every kernel of the compiled graph is
costed; each still counts one kernel launch). Everything outside the layers (embedding,
loss, the optimizer) stays eager, as in the trainer.

What this does not model: CUDA graphs, inductor's GEMM templates (max-autotune; mm stays the
aten extern kernel), mm epilogue fusion, and activation checkpointing of compiled layers.
It relies on inductor and dynamo internals (`Scheduler.codegen`, `compile_fx(inner_compile=)`,
`TorchDispatchMode.ignore_compile_internals`), exercised on torch 2.13 only.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import re
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path

import torch

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


class _Captured(Exception):
    """Raised from the patched `Scheduler.codegen` once the fused kernels are read off."""


@cache
def _qualnames(path: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function in a source file."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError):
        return []
    out: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((child.lineno, child.end_lineno or child.lineno, name))
                visit(child, name + ".")

    visit(tree, "")
    return out


def _qualname_at(path: str, line: int, fallback: str) -> str:
    best = None
    for first, last, name in _qualnames(path):
        if first <= line <= last and (best is None or first >= best[0]):
            best = (first, name)
    return best[1] if best else fallback


def node_category(rl, node: torch.fx.Node, short: str = "") -> str | None:
    """The roofline category of an FX node from the innermost model/ frame of its source line
    (`meta["stack_trace"]`; AOTAutograd copies it onto backward nodes), or None. `rl`: the
    roofline module."""
    MODEL_DIR = rl.MODEL_DIR
    trace = node.meta.get("stack_trace") or ""
    inner = None
    for path, line, fn in _FRAME.findall(trace):
        if path.startswith(MODEL_DIR):
            inner = (path, int(line), fn)
    if inner is None:
        return None
    path, line, fn = inner
    return rl._frame_category(path[len(MODEL_DIR):], _qualname_at(path, line, fn), short)


def _extern_name(snode) -> str | None:
    """`aten.mm`, `k3.row_norm`, ... of an extern scheduler node; None for MultiOutput."""
    node = snode.node
    if type(node).__name__ == "MultiOutput":
        return None
    op = getattr(node, "op_overload", None)
    if op is not None:
        name = str(getattr(op, "_overloadpacket", op))
    else:
        kernel = str(getattr(node, "python_kernel_name", None) or type(node).__name__)
        name = "aten." + kernel.rsplit(".", 1)[-1] if kernel.startswith("extern_kernels.") \
            else kernel
    return _normal(name)


def _normal(name: str) -> str:
    """`aten.scatter_reduce_.two` and `aten.scatter_reduce` compare equal."""
    parts = name.split(".")
    return ".".join(parts[:2]).rstrip("_")


class Region:
    """One compiled graph: its fused kernels and the names of its extern kernels."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.kernels: list[tuple[str, str, float, float]] = []  # name, category, bytes, elems
        self.externs: collections.Counter = collections.Counter()
        self.phase: str | None = None

    def read(self, scheduler, rl) -> None:
        from torch._inductor import scheduler as S

        for snode in scheduler.nodes:
            if isinstance(snode, S.NopKernelSchedulerNode):
                continue
            if isinstance(snode, S.ExternKernelSchedulerNode):
                name = _extern_name(snode)
                if name is not None:
                    self.externs[name] += 1
                continue
            parts = snode.get_nodes()
            cats = collections.Counter()
            elems = 0.0
            for part in parts:
                for origin in getattr(part.node, "origins", ()) or ():
                    cats[node_category(rl, origin) or "elementwise_norm"] += 1
                with contextlib.suppress(Exception):
                    elems += float(part.node.get_numel())
            kind = "inductor.reduction" if snode.is_reduction() else "inductor.pointwise"
            cat = cats.most_common(1)[0][0] if cats else "elementwise_norm"
            self.kernels.append((kind, cat, float(snode.get_read_write_buffers_sizes()),
                                 elems))


class _Runner(torch.fx.Interpreter):
    """Runs a partitioned graph on the fake tensors, telling the trace the category of each FX
    node as it runs (the region is set by the caller)."""

    def __init__(self, gm: torch.fx.GraphModule, trace, rl) -> None:
        super().__init__(gm)
        self.trace, self.rl = trace, rl

    def run_node(self, n: torch.fx.Node):
        if n.op == "call_function":
            short = getattr(n.target, "__name__", "").split(".")[0]
            self.trace.category_hint = node_category(self.rl, n, short)
        return super().run_node(n)


class CompiledRegions:
    """The torch.compile backend that records inductor's fused kernels per graph, and the
    substitution of those kernels for the eager glue in a trace."""

    def __init__(self, trace, rl) -> None:
        self.trace, self.rl = trace, rl  # rl: the roofline module (run as a script: __main__)
        self.regions: list[Region] = []

    def backend(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=self._inner,
                          config_patches={"cpu_backend": "triton", "fx_graph_cache": False})

    def _inner(self, gm: torch.fx.GraphModule, example_inputs, **kwargs):
        from functorch.compile import make_boxed_func
        from torch._inductor import scheduler as S
        from torch._inductor.compile_fx import compile_fx_inner

        region = Region(len(self.regions))
        self.regions.append(region)
        original = S.Scheduler.codegen

        def capture(scheduler) -> None:
            region.read(scheduler, self.rl)
            raise _Captured

        S.Scheduler.codegen = capture
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as e:  # noqa: BLE001 - only our own sentinel is expected
            if not _caused_by_capture(e):
                raise
        finally:
            S.Scheduler.codegen = original
        trace = self.trace

        def run(*args):
            outer_region, outer_hint = trace.region, trace.category_hint
            trace.region = region.index
            region.phase = trace.phase
            try:
                return _Runner(gm, trace, self.rl).run(*args)  # after post-grad passes
            finally:
                trace.region, trace.category_hint = outer_region, outer_hint

        return make_boxed_func(run)

    @contextlib.contextmanager
    def compiled(self, layers: Sequence[torch.nn.Module]) -> Iterator[None]:
        """`apply_compile` with this backend, undone (and dynamo reset) on exit."""
        from parallel.activation_checkpoint import apply_compile

        torch._dynamo.reset()
        saved = [layer.__dict__.get("forward") for layer in layers]
        config = torch._dynamo.config.get_config_copy()
        try:
            apply_compile(list(layers), backend=self.backend)
            for layer in layers:
                layer.forward = _without_function_modes(layer.forward)
            yield
        finally:
            for layer, fwd in zip(layers, saved):
                if fwd is None:
                    layer.__dict__.pop("forward", None)
                else:
                    layer.forward = fwd
            torch._dynamo.config.load_config(config)
            torch._dynamo.reset()

    def substitute(self, records: list) -> tuple[list, dict]:
        """Records with each region's eager glue replaced by its fused kernels, and the extern
        kernels no record matched, by name."""
        MATMUL_OPS, OpRecord = self.rl.MATMUL_OPS, self.rl.OpRecord

        left = {r.index: collections.Counter(r.externs) for r in self.regions}
        for region, name in self.trace.expanded_ops:  # a `k3::` op recorded as its body
            left[region][_normal(name)] -= 1
        out: list = []
        for rec in records:
            if rec.region is None or rec.expanded:
                out.append(rec)
                continue
            name = _normal(rec.name)
            if rec.name in MATMUL_OPS or rec.name.startswith("k3."):
                left[rec.region][name] -= 1
                out.append(rec)
            elif left[rec.region][name] > 0:
                left[rec.region][name] -= 1
                out.append(rec)
        for region in self.regions:
            for kind, cat, nbytes, elems in region.kernels:
                out.append(OpRecord(kind, cat, region.phase or "forward", 0.0, elems, nbytes, 1,
                                    region=region.index))
        unmatched: collections.Counter = collections.Counter()
        for region in self.regions:  # each still costs its launch
            for name, n in left[region.index].items():
                if n > 0:
                    unmatched[name] += n
                    out += [OpRecord(name, "elementwise_norm", region.phase or "forward", 0.0,
                                     0.0, 0.0, 1, region=region.index)] * n
        return out, dict(unmatched)


def _without_function_modes(fn):
    """Call `fn` with torch-function modes off: the roofline's node tagger (a Python
    TorchFunctionMode) would otherwise be traced into the compiled graph."""

    def call(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)

    return call


def _caused_by_capture(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, _Captured):
            return True
        e = e.__cause__ or e.__context__
    return False

