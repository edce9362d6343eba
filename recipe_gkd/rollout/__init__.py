"""Rollout workers: one RolloutWorker over an `hf` or `vllm` engine."""
