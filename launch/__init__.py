"""Entry points: `launch/pretrain.py` (Hydra + torchrun) and SLURM templates in `launch/slurm/`."""
