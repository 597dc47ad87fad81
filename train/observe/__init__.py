"""What a run measures and reports; nothing here changes the training maths.

- `observers.py`: `StepObservers`, the loop's one instrument panel (begin / end of a step ->
  the step's scalars), built from the pieces below;
- `metrics.py`: `MetricsLogger` (metrics.jsonl, console line, W&B, plots), `memory_stats`;
- `model_stats.py`, `layout_images.py`: the diagnostic images' arrays (expert load, router bias,
  AttnRes depth weights), for one rank and for any layout;
- `profiling.py`: `train.profile_steps` (torch.profiler trace and per-family summary);
- `flops.py`: model FLOPs per token and per document, GPU peaks, MFU;
- `host_syncs.py`: `HostSyncCounter` (every place a GPU would wait for the host);
- `stragglers.py`: each rank's compute time and the slow rank.
"""
