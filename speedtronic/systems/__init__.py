"""Devices and precision, torch.distributed (DDP, FSDP), shapes, CUDA streams."""
