"""Test-only fault injection: how the tests reach the trainer's failure paths. Never on in a
real run unless asked for (`debug.*`, `K3TRAIN_FAULT`).

- `nonfinite.py`: NaN losses, activations or gradients at chosen steps and ranks (`debug.*`),
  and `StepFaults`, the one context manager the loop enters around a step;
- `crash.py`: kill -9 of a rank at a chosen point, or a failed checkpoint write
  (`K3TRAIN_FAULT`, `K3TRAIN_FAULT_LOG`).
"""
