"""Entry points: `launch/pretrain.py` (Hydra + torchrun) and SLURM templates under `launch/slurm/`."""
