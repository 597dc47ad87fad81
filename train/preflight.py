"""The job's inputs checked before any process group starts: the data, the tokenizer, the batch
layout over the data ranks and the run directory's checkpoints.

`launch/pretrain.py` runs `preflight` after `validate_job` (the config alone), so a bad input
(a missing validation split when `eval.every` is set included) fails in one line
(`ConfigError`: names the field or file and the fix), exit code 2, nothing written, whether
the job has one rank or thousands; the trainer builds the same loaders again for its own data
rank (`build_loader`, `build_val_loader`) and logs `describe_data`: the corpus and the epochs
one step and the whole run read, with warnings.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from data.corpus import default_corpus_dir
from data.dataset import PackedTokenDataset
from data.loader import BatchLoader
from data.tokenizer import load_tokenizer
from model.config import ConfigError
from train.checkpoint.checkpointer import published_steps
from train.config import JobConfig


def dataset_folder(job: JobConfig) -> Path:
    d = job.data
    return (default_corpus_dir(d.tokenizer, max_bytes=d.stdlib_max_bytes)
            if d.dataset == "stdlib" else Path(d.dataset))


def open_dataset(job: JobConfig, split: str | None = None) -> PackedTokenDataset:
    """The packed token windows of `data.dataset` (or its `split` subfolder) at `data.seq_len`."""
    d = job.data
    folder = dataset_folder(job)
    if split is not None:
        if not (folder / split / "manifest.json").is_file():
            raise ConfigError(f"eval.every={job.eval.every} but data.dataset={str(folder)!r} "
                              f"has no {split} split; prepare it with `python -m data.prepare "
                              "... --val-fraction 0.01` or set eval.every=0")
        folder = folder / split
    try:
        return PackedTokenDataset(folder, d.seq_len)
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"data.dataset={str(folder)!r} is unreadable ({what}); re-run "
                          f"`python -m data.prepare ... --output {folder} --overwrite`") from None


def build_loader(job: JobConfig, dp_rank: int, dp: int) -> BatchLoader:
    """Data rank `dp_rank`'s loader, after the tokenizer and vocabulary checks."""
    d = job.data
    try:  # first: the default corpus is tokenized with it
        vocab = load_tokenizer(d.tokenizer).vocab_size
    except Exception as e:  # tokenizers' own errors for a JSON file that is not a tokenizer
        what = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} cannot be loaded ({what}); give a "
                          "Hugging Face tokenizer.json or data.tokenizer=byte") from None
    if vocab > job.model.vocab_size:
        raise ConfigError(f"data.tokenizer has {vocab} tokens but model.vocab_size="
                          f"{job.model.vocab_size}; raise model.vocab_size to >= {vocab}")
    dataset = open_dataset(job)
    if dataset.vocab_size > job.model.vocab_size:
        raise ConfigError(f"data.dataset was prepared with {dataset.vocab_size} token ids but "
                          f"model.vocab_size={job.model.vocab_size}; raise model.vocab_size")
    try:
        return BatchLoader(dataset, d.global_batch, d.micro_batch, dp_rank, dp, d.seed,
                           d.shuffle_block_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_val_loader(job: JobConfig, dp_rank: int, dp: int) -> BatchLoader | None:
    """Data rank `dp_rank`'s loader of the validation split (None without `eval.every`)."""
    if not job.eval.every:
        return None
    d = job.data
    dataset = open_dataset(job, "val")
    try:
        return BatchLoader(dataset, d.global_batch, d.micro_batch, dp_rank, dp, d.seed)
    except ValueError as e:
        raise ConfigError(f"the validation split: {e}") from None


def describe_data(job: JobConfig, loader: BatchLoader, val: BatchLoader | None
                  ) -> tuple[list[str], list[str]]:
    """(lines, warnings) saying what the corpus holds and how often a step and the run read
    it, so a preset batch far larger than a small corpus is seen before the first step."""
    d, ds = job.data, loader.dataset
    docs = len(ds.doc_starts)
    windows = loader.num_samples
    per_step = d.global_batch / windows  # epochs
    run = per_step * job.train.steps
    lines = [f"data: {dataset_folder(job)}: {docs} documents, {ds.total_tokens} tokens, "
             f"{windows} windows of data.seq_len={d.seq_len}; a step reads "
             f"data.global_batch={d.global_batch} windows ({per_step:.3g} epochs), the run "
             f"(train.steps={job.train.steps}) {run:.3g} epochs"]
    if val is not None:
        vds = val.dataset
        lines.append(f"validation: {len(vds.doc_starts)} documents, {vds.total_tokens} tokens, "
                     f"{val.num_samples} windows; each evaluation reads eval.batches="
                     f"{job.eval.batches} x {d.global_batch} windows every eval.every="
                     f"{job.eval.every} steps")
    warnings = []
    if per_step > 1:
        warnings.append(f"warning: one step reads the whole corpus {per_step:.3g} times "
                        f"(data.global_batch={d.global_batch} windows of {d.seq_len} tokens, "
                        f"{windows} in the corpus); lower data.global_batch or data.seq_len, "
                        "or prepare more text")
    if run > d.max_epochs:
        warnings.append(f"warning: the run reads the corpus {run:.3g} times, more than "
                        f"data.max_epochs={d.max_epochs:g}; prepare more text, lower "
                        "train.steps, or raise data.max_epochs if that is intended")
    return lines, warnings


def newest_train_state(run_dir: Path) -> dict | None:
    """train_state.json of the run directory's newest published checkpoint (None: none)."""
    root = run_dir / "checkpoints"
    for step in reversed(published_steps(root)):
        try:
            return json.loads((root / f"step-{step:08d}" / "train_state.json").read_text())
        except (OSError, ValueError):
            continue  # a damaged checkpoint: the trainer names it and takes an older one
    return None


def check_same_model(job: JobConfig) -> None:
    """A run directory holding checkpoints of another model or optimizer is refused."""
    if not (job.checkpoint.enabled and job.checkpoint.resume):
        return
    state = newest_train_state(job.run_dir)
    if state is None:
        return
    run_dir = job.run_dir
    saved = state.get("model_config", {})
    diff = sorted(k for k, v in asdict(job.model).items() if saved.get(k) != v)
    if diff:
        raise ConfigError(f"run.dir={str(run_dir)!r} holds checkpoints of a different model "
                          f"(model.{diff[0]} differs); use another run.dir or the same model")
    optim = state.get("optim_name", "adamw")  # checkpoints before optim=muon: adamw
    if optim != job.optim.name and not state.get("weights_only"):  # imports hold no optimizer
        raise ConfigError(f"run.dir={str(run_dir)!r} holds checkpoints of optim={optim}, this "
                          f"run has optim={job.optim.name}; use another run.dir (or run.name) "
                          f"or optim={optim}")


def check_release(job: JobConfig) -> None:
    """checkpoint.init_from on a new run: every tensor's name and shape fits the model (the
    safetensors headers only)."""
    from train.checkpoint.release_reader import ImportHFError, ReleaseReader

    fresh = not (job.checkpoint.enabled and job.checkpoint.resume) \
        or newest_train_state(job.run_dir) is None
    if not job.checkpoint.init_from or not fresh:
        return
    try:
        ReleaseReader(job.checkpoint.init_from, job.model).read_metadata()
    except ImportHFError as e:
        raise ConfigError(f"checkpoint.init_from={job.checkpoint.init_from!r}: {e}") from None


def preflight(job: JobConfig, world_size: int) -> None:
    """Every input check that needs files; raises ConfigError (one line)."""
    from parallel.dims import ParallelDims

    check_same_model(job)
    check_release(job)
    dp = ParallelDims.from_config(job.parallel, world_size).dp
    build_loader(job, 0, dp)
    build_val_loader(job, 0, dp)
