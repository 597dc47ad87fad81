"""k3train model: the Kimi K3 architecture as plain single-device PyTorch (no torch.distributed)."""
