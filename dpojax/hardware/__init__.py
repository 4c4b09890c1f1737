"""Accelerators as data: published figures of TPU and GPU chips (`chips`) and the GPU target
descriptions that XLA compiles for without the device (`gpu_targets`)."""
