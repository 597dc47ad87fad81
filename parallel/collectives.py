"""Autograd-aware collectives used by tensor and sequence parallelism (torch 2.11-2.14)."""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol

# torch >= 2.12 names them *_single_autograd; 2.11 has only the *_tensor_autograd spelling.
# all_gather's backward is a reduce-scatter of the incoming (partial) gradients, and vice versa.
all_gather = (getattr(funcol, "all_gather_single_autograd", None)
              or funcol.all_gather_tensor_autograd)
reduce_scatter = (getattr(funcol, "reduce_scatter_single_autograd", None)
                  or funcol.reduce_scatter_tensor_autograd)
