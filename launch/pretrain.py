"""Train a K3 model: `torchrun --nproc_per_node=N launch/pretrain.py +cluster=<name> [overrides]`.

Composes `configs/` with Hydra (compose API: no per-rank output folders or log files), validates
the whole job against the world size before any process group starts, then trains. Running the
same command again resumes from the latest intact checkpoint in the run directory, and so does a
worker group that torchrun restarts (`--max-restarts=K`) after a rank dies. A bad config
prints one line naming the field and the fix, exits with code 2 and writes nothing. With no
`model=`, `model.*` or `+recipe=` override, a run directory holding checkpoints (an import by
`train.checkpoint.import_hf`, say) trains the model they hold. `checkpoint.init_from=<HF dir>`
starts a new run from a release's weights and config.json (`model.FIELD=V` on top).
Extra flag: `--print-config` prints the resolved config and exits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import OmegaConf, open_dict  # noqa: E402

from model.config import ConfigError  # noqa: E402
from train.config import JobConfig, validate_job  # noqa: E402

CONFIG_DIR = ROOT / "configs"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    cause = e.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text += " (" + " ".join(str(cause).split()) + ")"
    return text


def load_job(overrides: list[str], world_size: int, check_device: bool = True) -> JobConfig:
    """Compose and validate; raises ConfigError with a one-line message."""
    job, _ = compose_job(overrides)
    if job.checkpoint.init_from:  # also once the run has checkpoints: the same model
        _model_from_release(job, overrides)
    elif not any(o.lstrip("+~").startswith(MODEL_CHOICES) for o in overrides):
        _model_from_run_dir(job)
    return validate_job(job, world_size, check_device)


def compose_job(overrides: list[str]) -> tuple[JobConfig, str]:
    """(the job composed from configs/ and `overrides`, unvalidated; the model preset chosen);
    raises ConfigError with a one-line message. `run.name` defaults to k3-<preset>."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        model_choice = cfg.hydra.runtime.choices.get("model", "model")
        if "cluster" not in cfg.hydra.runtime.choices:
            raise ConfigError("no cluster chosen; add +cluster=local_cpu (or +cluster=gpu_node8, "
                              f"see {CONFIG_DIR / 'cluster'})")
        with open_dict(cfg):
            del cfg["hydra"]
        job: JobConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except ConfigError:
        raise
    except Exception as e:  # Hydra/OmegaConf composition and type errors
        raise ConfigError(_one_line(e)) from None
    if job.run.name is None:
        job.run.name = f"k3-{model_choice}"
    return job, model_choice


MODEL_CHOICES = ("model=", "model.", "recipe=")


def _model_from_run_dir(job: JobConfig) -> None:
    """No model on the command line and a run directory with checkpoints: train the model
    they hold (an imported K3, a run started with model=k3_small) rather than the default."""
    if not (job.checkpoint.enabled and job.checkpoint.resume):
        return
    from model.config import ModelConfig
    from train.preflight import newest_train_state

    state = newest_train_state(job.run_dir)
    if state is not None and "model_config" in state:
        job.model = ModelConfig.from_dict(state["model_config"])


def _model_from_release(job: JobConfig, overrides: list[str]) -> None:
    """checkpoint.init_from: the model is the release's config.json, with the command line's
    model.FIELD=V (fields that change no weight, such as kda_chunk_size) on top."""
    from model.inspect import parse_model_overrides
    from train.checkpoint.import_hf import (
        ImportHFError,
        model_config_from_release,
        read_release_config,
    )

    folder = Path(job.checkpoint.init_from)
    if any(o.lstrip("+~").startswith("model=") for o in overrides):
        raise ConfigError("checkpoint.init_from takes the model from its config.json; drop "
                          "model=... (model.FIELD=VALUE still sets fields that change no weight)")
    fields = parse_model_overrides([o for o in overrides if o.startswith("model.")])
    try:
        job.model = model_config_from_release(read_release_config(folder), overrides=fields)[0]
    except ImportHFError as e:
        hint = (" (a flag of python -m train.checkpoint.import_hf: import the release with it, "
                "then run.dir=<the import>)") if "--ignore-field" in str(e) else ""
        raise ConfigError(f"checkpoint.init_from={str(folder)!r}: {e}{hint}") from None


def main(argv: list[str]) -> int:
    from train.distributed import world_size_from_env

    rank = int(os.environ.get("RANK", "0"))
    print_config = "--print-config" in argv
    overrides = [a for a in argv if a != "--print-config"]
    try:
        job = load_job(overrides, world_size_from_env())
        if not print_config:
            from train.preflight import preflight

            preflight(job, world_size_from_env())  # data, tokenizer, run directory
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if print_config:
        if rank == 0:
            print(OmegaConf.to_yaml(OmegaConf.structured(job)))
        return 0

    from train.distributed import init_distributed, shutdown
    from train.faults import crash as crash_faults
    from train.trainer import TrainingStopped, train

    crash_faults.record("start")  # test-only (K3TRAIN_FAULT_LOG): when this worker began
    env = init_distributed(job.cluster.device, job.cluster.backend, job.cluster.timeout_s)
    try:
        train(job, env)
    except ConfigError as e:  # checks that need the data or the run directory
        if env.is_main:
            print(f"error: {e}", file=sys.stderr)
        shutdown(2)
    except TrainingStopped as e:
        if env.is_main:
            print(f"error: {e}", file=sys.stderr)
        shutdown(3)
    except BaseException:
        import traceback

        traceback.print_exc()
        shutdown(1)
    shutdown(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
