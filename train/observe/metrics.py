"""Per-step metrics of a training run: metrics.jsonl, a console line, W&B, and diagnostic plots.

`MetricsLogger` is the one sink the trainer talks to. Only rank 0 writes; on other ranks every
call is a no-op. Per optimizer step `log_step(step, scalars)` appends `{"step", "time", **scalars}`
to `<run_dir>/metrics.jsonl` (flushed per line; non-finite floats are written as Python's json
does, NaN / Infinity), prints one console line and logs the scalars to W&B at that step.
Console keys: loss, lr, grad_norm, tokens_per_sec, mfu (a fraction; omitted when None) and
max_mem_gib (see `memory_stats`); every key goes to the file and to W&B.

W&B: mode "auto" is online when an API key is configured (WANDB_API_KEY or a ~/.netrc entry for
the W&B host), else offline. Every W&B directory (WANDB_DIR, cache, config, artifacts, data) is
pointed into the run directory, and the run id is kept in `wandb_run_id.txt`, so a resumed job
continues the same run (`resume="allow"`). W&B keeps its own history: after a resume it ignores
re-logged steps at or below the last step it had, while metrics.jsonl is cut back by `start`.

Plots (`log_images`, ~1-3 s on rank 0 at K3 size, 10-70 kB palette PNGs in run_dir/plots, also
logged as `wandb.Image`): expert load / mean heatmap, AttnRes depth-weight heatmap, router-bias
histograms (up to 8 evenly spaced MoE layers). matplotlib's object API with the Agg canvas is
used, never pyplot, so no global backend is touched.

Deliberately does not: reduce values across ranks, compute throughput, or decide when to log.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import resource
import secrets
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch

from train.observe.model_stats import attnres_source_labels

WANDB_MODES = ("auto", "online", "offline", "disabled")
CONSOLE_FIELDS = (("loss", "loss {:.4f}"), ("mtp_loss", "mtp {:.4f}"),
                  ("val_loss", "val {:.4f}"),
                  ("lr", "lr {:.2e}"), ("grad_norm", "gnorm {:.3f}"),
                  ("tokens_per_sec", "tok/s {:,.0f}"), ("mfu", "mfu {:.1%}"),
                  ("max_mem_gib", "mem {:.2f} GiB"))
PLOT_DPI = 100


def memory_stats(device: torch.device | str) -> dict[str, float]:
    """{"max_mem_gib": peak CUDA allocation, or on CPU the process's peak RSS, in GiB}."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"max_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"max_mem_gib": rss / (2**30 if sys.platform == "darwin" else 2**20)}


def wandb_key_configured() -> bool:
    """True if WANDB_API_KEY is set or the netrc file has an entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return path.is_file() and netrc.netrc(path).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(mode: str) -> str:
    if mode not in WANDB_MODES:
        raise ValueError(f"metrics.wandb_mode={mode!r}: use one of {', '.join(WANDB_MODES)}")
    if mode == "auto":
        return "online" if wandb_key_configured() else "offline"
    return mode


def _scalar(v: Any) -> float | int | str | bool | list | None:
    if v is None or isinstance(v, (bool, int, float, str, list)):
        return v
    return v.item() if hasattr(v, "item") else float(v)  # numpy / torch scalars


def format_step_line(step: int, total: int, scalars: dict[str, Any]) -> str:
    parts = [f"step {step}/{total}"]
    for key, fmt in CONSOLE_FIELDS:
        v = scalars.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            parts.append(fmt.format(v) if math.isfinite(v) else f"{fmt.split()[0]} {v}")
    return " | ".join(parts)


def _progress_display() -> Any:
    """A rich progress bar (step m/n, bar, ETA) with the step's scalars on a line below it."""
    import rich.progress as rp
    from rich.text import Text

    class StepProgress(rp.Progress):
        stats_line = ""

        def get_renderables(self) -> Any:
            yield self.make_tasks_table(self.tasks)
            yield Text(self.stats_line)

    return StepProgress(rp.TextColumn("[bold]step"), rp.MofNCompleteColumn(),
                        rp.BarColumn(bar_width=32), rp.TimeElapsedColumn(), rp.TextColumn("eta"),
                        rp.TimeRemainingColumn(), refresh_per_second=4)


def _truncate_jsonl(path: Path, resume_step: int) -> None:
    """Keep only well-formed lines with step <= resume_step (atomic rewrite)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= resume_step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # e.g. a line cut short by a crash
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def wandb_values(values: dict) -> dict[str, float | int]:
    """The W&B form of a metrics record: scalars as they are; per-layer lists (same length as
    `moe_layer_ids`, or `mla_layer_ids` for the `attn_*` ones) become one chart per layer,
    `<key>/L<layer>`; other lists are dropped."""
    out: dict[str, float | int] = {}
    for k, v in values.items():
        if v is None or k in ("moe_layer_ids", "mla_layer_ids", "sample_ids"):
            continue
        if isinstance(v, list):
            layers = values.get("mla_layer_ids" if k.startswith("attn_") else "moe_layer_ids")
            layers = layers or []
            if len(v) == len(layers) and all(isinstance(x, (int, float)) for x in v):
                out.update({f"{k}/L{layer}": x for layer, x in zip(layers, v, strict=True)})
            continue
        out[k] = v
    return out


class MetricsLogger:
    def __init__(self, run_dir: Path, rank: int, total_steps: int, config: dict,
                 wandb_mode: str = "auto", wandb_project: str = "k3train",
                 run_name: str | None = None, console: bool = True) -> None:
        self.run_dir, self.rank, self.total_steps = Path(run_dir), rank, total_steps
        self.config, self.wandb_project, self.run_name = config, wandb_project, run_name
        self.wandb_mode = resolve_wandb_mode(wandb_mode) if rank == 0 else "disabled"
        self.console = console
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.wandb_run: Any = None
        self._file: Any = None
        self._progress: Any = None
        self._task: Any = None
        self._started = False

    @property
    def active(self) -> bool:
        return self.rank == 0

    # ----------------------------------------------------------------- lifecycle
    def start(self, resume_step: int = 0) -> None:
        """Call once at startup: cut metrics.jsonl back to resume_step, open W&B and console."""
        if not self.active:
            return
        if self._started:
            raise RuntimeError("MetricsLogger.start() was already called")
        self._started = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _truncate_jsonl(self.metrics_path, resume_step)
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        self.wandb_run = self._init_wandb()
        if self.console and sys.stdout.isatty():
            self._progress = _progress_display()
            self._task = self._progress.add_task("train", total=self.total_steps,
                                                 completed=resume_step)
            self._progress.start()

    def close(self) -> None:
        """Flush and close everything; safe to call twice."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _init_wandb(self) -> Any:
        if self.wandb_mode == "disabled":
            return None
        import wandb

        for var, sub in (("WANDB_DIR", ""), ("WANDB_CACHE_DIR", "wandb/.cache"),
                         ("WANDB_CONFIG_DIR", "wandb/.config"),
                         ("WANDB_ARTIFACT_DIR", "wandb/.artifacts"),
                         ("WANDB_DATA_DIR", "wandb/.data")):
            path = self.run_dir / sub
            path.mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(path.resolve())
        id_file = self.run_dir / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        kwargs = dict(project=self.wandb_project, name=self.run_name, id=run_id, resume="allow",
                      dir=str(self.run_dir.resolve()), config=self.config,
                      settings=wandb.Settings(console="off"))
        try:
            run = wandb.init(mode=self.wandb_mode, **kwargs)
        except Exception as e:  # a W&B outage must not stop training
            if self.wandb_mode != "online":
                raise
            warnings.warn(f"W&B online init failed ({e}); logging offline under "
                          f"{self.run_dir / 'wandb'} (upload later with `wandb sync`)",
                          stacklevel=2)
            self.wandb_mode = "offline"
            run = wandb.init(mode="offline", **kwargs)
        id_file.write_text(run.id + "\n")
        return run

    # ------------------------------------------------------------------- logging
    def log_step(self, step: int, scalars: dict[str, float | int | None]) -> None:
        """One optimizer step: a metrics.jsonl line, a console line and a W&B log."""
        if not self.active:
            return
        if not self._started:
            raise RuntimeError("call MetricsLogger.start(resume_step) before log_step")
        values = {k: _scalar(v) for k, v in scalars.items()}
        record = {"step": int(step), "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.console:
            line = format_step_line(step, self.total_steps, values)
            if self._progress is not None:
                self._progress.stats_line = line.split(" | ", 1)[1] if " | " in line else ""
                self._progress.update(self._task, completed=step)
            else:
                print(line, flush=True)
        if self.wandb_run is not None:
            self.wandb_run.log(wandb_values(values), step=step)

    def log_images(self, step: int, expert_load: np.ndarray, attnres_weights: np.ndarray,
                   attnres_labels: list[str], router_bias: np.ndarray,
                   moe_layer_ids: Sequence[int] | None = None) -> dict[str, Path]:
        """Render the three diagnostic PNGs into run_dir/plots and log them to W&B; the arrays
        go to run_dir/plots/images-step-<step>.npz.

        expert_load, router_bias: [n_moe_layers, n_experts]; attnres_weights: [n_mixes,
        max_sources] (current prefix in the last column, NaN where a mix lacks a source);
        moe_layer_ids: decoder layer index of each MoE row (default: row numbers).
        """
        if not self.active:
            return {}
        expert_load, router_bias = np.asarray(expert_load), np.asarray(router_bias)
        ids = list(moe_layer_ids) if moe_layer_ids is not None else None
        figures = {
            "expert_load": _expert_load_figure(expert_load, step, ids),
            "attnres_depth": _attnres_figure(np.asarray(attnres_weights), attnres_labels, step),
            "router_bias": _router_bias_figure(router_bias, step, ids),
        }
        out_dir = self.run_dir / "plots"
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name, fig in figures.items():
            paths[name] = out_dir / f"{name}-step-{step:08d}.png"
            fig.set_dpi(PLOT_DPI)
            _save_png(fig, paths[name])
        data = out_dir / f"images-step-{step:08d}.npz"  # the plotted arrays, for analysis
        tmp = data.with_name(data.name + ".tmp.npz")
        np.savez(tmp, expert_load=expert_load, router_bias=router_bias,
                 attnres_weights=np.asarray(attnres_weights), attnres_labels=np.array(
                     attnres_labels), moe_layer_ids=np.array(ids if ids is not None else []))
        tmp.replace(data)
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.log({f"plots/{k}": wandb.Image(str(p)) for k, p in paths.items()},
                               step=step)
        return paths


# --------------------------------------------------------------------------- figures
def _tick_every(n: int, max_ticks: int) -> list[int]:
    return list(range(0, n, max(1, math.ceil(n / max_ticks))))


def _expert_load_figure(load: np.ndarray, step: int, ids: list[int] | None) -> Any:
    import matplotlib
    from matplotlib.colors import BoundaryNorm
    from matplotlib.figure import Figure

    load = load.astype(np.float64)  # [L, E]
    mean = load.mean(axis=1, keepdims=True)  # [L, 1]
    rel = np.divide(load, mean, out=np.full(load.shape, np.nan), where=mean > 0)  # [L, E]
    finite = np.isfinite(rel).any()
    peak = np.nanmax(np.where(np.isfinite(rel), rel, -1.0), axis=1)  # [L], -1 for idle layers
    worst = int(np.argmax(peak)) if len(peak) else 0
    # Discrete bins, white = within 5% of the mean: readable at a glance and compresses well.
    bounds = [0, 0.25, 0.5, 0.8, 0.95, 1.05, 1.25, 2, 4, max(8.0, float(np.nanmax(rel)) + 1e-9
                                                          if finite else 8.0)]
    cmap = matplotlib.colormaps["RdBu_r"].resampled(len(bounds) - 1).with_extremes(bad="0.6")
    names = ids if ids is not None else list(range(len(load)))
    fig = Figure(figsize=(8, float(np.clip(1.6 + 0.05 * len(load), 2.6, 6))), layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(rel), aspect="auto", cmap=cmap,
                   norm=BoundaryNorm(bounds, cmap.N), interpolation="nearest")
    worst_txt = f"{peak[worst]:.2f} (layer {names[worst]})" if finite else "n/a (no tokens)"
    ax.set_title(f"Expert load / layer mean, step {step}: worst max/mean = {worst_txt}",
                 fontsize=10)
    ax.set_ylabel("decoder layer" if ids is not None else "MoE layer #")
    rows = _tick_every(len(load), 24)
    ax.set_yticks(rows, [str(names[r]) for r in rows], fontsize=7)
    ax.set_xlabel("expert   (white: within 5% of the layer mean; grey: layer saw no tokens)")
    cbar = fig.colorbar(im, ax=ax, label="load / mean", format="%g")
    cbar.ax.tick_params(labelsize=7)
    return fig


def _attnres_figure(weights: np.ndarray, labels: list[str], step: int) -> Any:
    import matplotlib
    from matplotlib.figure import Figure

    n_mix, n_src = weights.shape
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.88")
    vmax = float(np.nanmax(weights)) if np.isfinite(weights).any() else 1.0
    fig = Figure(figsize=(float(np.clip(2.6 + 0.6 * n_src, 4, 7.5)),
                          float(np.clip(1.2 + 0.2 * n_mix, 3, 8))),
                 layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(weights), aspect="auto", cmap=cmap, vmin=0, vmax=vmax,
                   interpolation="nearest")
    ax.set_xticks(range(n_src), attnres_source_labels(n_src), fontsize=8)
    rows = _tick_every(n_mix, 48)
    ax.set_yticks(rows, [labels[r] for r in rows], fontsize=7)
    if n_mix <= 40 and n_src <= 12:
        for r, c in zip(*np.nonzero(np.isfinite(weights))):
            v = weights[r, c]
            ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6,
                    color="black" if v > 0.6 * vmax else "white")
    ax.set_title(f"AttnRes depth weights (token mean), step {step}", fontsize=10)
    ax.set_xlabel("source   (grey: not yet a source of this mix)", fontsize=9)
    fig.colorbar(im, ax=ax, label="depth weight (rows sum to 1)")
    return fig


def _router_bias_figure(bias: np.ndarray, step: int, ids: list[int] | None) -> Any:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    n = len(bias)
    names = ids if ids is not None else list(range(n))
    shown = np.unique(np.linspace(0, n - 1, min(n, 8)).round().astype(int)) if n else []
    ncols = max(1, min(4, len(shown)))
    nrows = max(1, math.ceil(len(shown) / ncols))
    lim = max(float(np.abs(bias).max()) if bias.size else 0.0, 1e-3) * 1.05
    height = 1.6 * nrows + 0.9
    fig = Figure(figsize=(2.2 * ncols + 0.4, height))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.5 / height, top=1 - 0.5 / height,
                        wspace=0.3, hspace=0.5)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True).ravel()
    for ax, r in zip(axes, shown):
        ax.hist(bias[r], bins=30, range=(-lim, lim), color="tab:blue")
        ax.axvline(0.0, color="0.4", lw=0.8, ls="--")
        ax.set_title(f"layer {names[r]}: std {bias[r].std():.2g}", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(3))
    for ax in axes[len(shown):]:
        ax.set_axis_off()
    fig.suptitle(f"Router bias histograms, step {step} ({len(shown)} of {n} MoE layers)",
                 fontsize=10)
    fig.supxlabel("router bias (y: number of experts)", fontsize=8)
    return fig


def _save_png(fig: Any, path: Path) -> None:
    """Render with Agg and store as an optimised 8-bit palette PNG (a few tens of kB)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgb = np.asarray(canvas.buffer_rgba())[..., :3]  # [H, W, 3] uint8
    Image.fromarray(rgb).quantize(256, method=Image.Quantize.FASTOCTREE).save(path, optimize=True)
