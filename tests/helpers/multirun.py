"""Several training jobs in one launch: `torchrun ... tests/helpers/multirun.py JOBS.json`.

A 4-rank launch on the 2-core CI machine spends a large share of a short run starting up (four
interpreters importing torch, DTensor's and the meta registrations' first calls); running a test
module's layouts one after another in the same processes pays that once. Each
job is exactly what `launch/pretrain.py` does with its overrides (`load_job`, then `train` on
the process group initialised once); rank 0's console output goes to `<run dir>.stdout`. JOBS.json
is a list of `[run_dir, [overrides...]]`. Any failure prints its traceback and exits 1.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch"))

from pretrain import load_job  # noqa: E402

from train.distributed import init_distributed, shutdown, world_size_from_env  # noqa: E402


def main(jobs_file: str) -> None:
    import torch.distributed as dist

    from train.trainer import train

    for run_dir, overrides in json.loads(Path(jobs_file).read_text()):
        job = load_job(overrides, world_size_from_env())
        env = init_distributed(job.cluster.device, job.cluster.backend, job.cluster.timeout_s)
        with contextlib.ExitStack() as stack:
            if env.is_main:
                out = stack.enter_context(open(f"{run_dir}.stdout", "w"))
                stack.enter_context(contextlib.redirect_stdout(out))
            train(job, env)
        dist.barrier()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        shutdown(1)
    shutdown(0)
