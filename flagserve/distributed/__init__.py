"""Tensor/pipeline-parallel plumbing: process groups, stage-to-stage activations, placement."""
