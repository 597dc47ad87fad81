"""`train.profile_steps=[a, b]`: a torch.profiler trace of steps a..b and a per-family summary.

What: from the start of step a to the end of step b (1-based, inclusive) `StepProfiler` runs
`torch.profiler.profile` (CPU, plus CUDA on a GPU) with `record_function` ranges:
- `k3/step`: each profiled optimizer step;
- `k3/layer.<i>.<attention>_<ffn>` around every decoder layer's forward (e.g. kda_moe, mla_dense);
- one range per op family around the forward of its modules (`FAMILIES`: MLA, KDA, short conv,
  MoE router / routed experts / shared experts, dense MLP, norms, embedding);
- `k3/optimizer` around `optimizer.step` (an optimizer step hook pair).
Backward has no module ranges (module hooks do not fire there); its time is the sum of the
profiler's `autograd::engine::evaluate_function` events, reported as "backward".
At the end of step b each rank writes `profile/trace-rank<r>.json` (Chrome trace JSON: open in
Perfetto, ui.perfetto.dev, or chrome://tracing) and `profile/summary-rank<r>.json` into the run
directory, and rank 0 prints the summary: per range name, calls, CPU ms and device ms (totals:
a layer's range contains its families' ranges).

The hooks exist only while profiling, so steps outside [a, b] run exactly as without it. With
`parallel.compile=true` the per-family ranges sit inside compiled layers; they are installed
after compilation and dynamo may break the graph around them while profiling (layer ranges
wrap the compiled forward from outside and cost nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

# module class name -> family name of its forward range
FAMILIES = {
    "GatedMLA": "mla_attention", "KimiDeltaAttention": "kda", "ShortConv": "short_conv",
    "Router": "moe_router", "RoutedExperts": "moe_routed_experts", "SiTUMLP": "mlp",
    "RMSNorm": "norm", "GatedRMSNorm": "norm", "Embedding": "embedding",
}


class StepProfiler:
    """Profile steps [first, last] of a run (`steps` None or empty: never)."""

    def __init__(self, steps, model: nn.Module, optimizer: torch.optim.Optimizer,
                 run_dir: Path, rank: int, device: torch.device) -> None:
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps else (0, -1)
        self.model, self.optimizer = model, optimizer
        self.out_dir, self.rank, self.device = Path(run_dir) / "profile", rank, device
        self.prof: profile | None = None
        self.handles: list = []
        self.step_range: record_function | None = None

    def _hook_modules(self) -> None:
        def enter(name):
            def pre(module, args, kwargs=None):
                ctx = record_function(name)
                ctx.__enter__()
                module._k3_profile_ranges = getattr(module, "_k3_profile_ranges", []) + [ctx]
            return pre

        def leave(module, args, out):
            module._k3_profile_ranges.pop().__exit__(None, None, None)

        layers = getattr(self.model, "layers", {})
        types = getattr(getattr(self.model, "config", None), "layer_types", None)
        for key, layer in layers.items():
            kind = types[int(key)] if types is not None else "layer"
            ffn = "moe" if hasattr(layer, "block_sparse_moe") else "dense"
            self._add(layer, enter(f"k3/layer.{key}.{kind}_{ffn}"), leave)
        for module in self.model.modules():
            name = type(module).__name__
            family = FAMILIES.get(name[4:] if name.startswith("FSDP") else name)  # FSDP2 class
            if family is not None:
                self._add(module, enter(f"k3/{family}"), leave)
        opt_ctx: list[record_function] = []

        def opt_pre(opt, args, kwargs):
            opt_ctx.append(record_function("k3/optimizer"))
            opt_ctx[-1].__enter__()

        def opt_post(opt, args, kwargs):
            opt_ctx.pop().__exit__(None, None, None)

        self.handles += [self.optimizer.register_step_pre_hook(opt_pre),
                         self.optimizer.register_step_post_hook(opt_post)]

    def _add(self, module: nn.Module, pre, post) -> None:
        self.handles += [module.register_forward_pre_hook(pre),
                         module.register_forward_hook(post)]

    def before_step(self, step: int) -> None:
        """Call with the 1-based number of the step about to run."""
        if step == self.first:
            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=acts, record_shapes=False)
            self.prof.__enter__()
            self._hook_modules()
        if self.prof is not None:
            self.step_range = record_function("k3/step")
            self.step_range.__enter__()

    def after_step(self, step: int) -> dict | None:
        """Call after the step; at the last profiled step returns the summary (else None)."""
        if self.prof is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_range.__exit__(None, None, None)
        if step < self.last:
            return None
        for h in self.handles:
            h.remove()
        self.handles = []
        self.prof.__exit__(None, None, None)
        summary = summarize(self.prof, self.first, self.last)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.out_dir / f"trace-rank{self.rank}.json"))
        (self.out_dir / f"summary-rank{self.rank}.json").write_text(json.dumps(summary, indent=1))
        self.prof = None
        return summary


def _device_us(evt) -> float:
    for name in ("device_time_total", "cuda_time_total"):  # renamed across torch versions
        v = getattr(evt, name, None)
        if v is not None:
            return float(v)
    return 0.0


def summarize(prof: profile, first: int, last: int) -> dict:
    """{range name: {calls, cpu_ms, device_ms}} for our `k3/` ranges, plus "backward" (the
    autograd engine's per-node events summed) and the profiled steps."""
    rows: dict[str, dict] = {}
    backward = {"calls": 0, "cpu_ms": 0.0, "device_ms": 0.0}
    for evt in prof.key_averages():
        if evt.key.startswith("k3/"):
            rows[evt.key[3:]] = {"calls": evt.count, "cpu_ms": evt.cpu_time_total / 1e3,
                                 "device_ms": _device_us(evt) / 1e3}
        elif evt.key.startswith("autograd::engine::evaluate_function"):
            backward["calls"] += evt.count
            backward["cpu_ms"] += evt.cpu_time_total / 1e3
            backward["device_ms"] += _device_us(evt) / 1e3
    rows["backward"] = backward
    return {"steps": [first, last], "ranges": dict(sorted(rows.items()))}


def format_summary(summary: dict) -> str:
    """A plain table of the summary (what rank 0 prints)."""
    lines = [f"profile steps {summary['steps'][0]}-{summary['steps'][1]} "
             f"(ms; a layer's time includes its families')",
             f"{'range':<32} {'calls':>7} {'cpu ms':>10} {'device ms':>10}"]
    for name, r in summary["ranges"].items():
        lines.append(f"{name:<32} {r['calls']:>7} {r['cpu_ms']:>10.2f} {r['device_ms']:>10.2f}")
    return "\n".join(lines)
