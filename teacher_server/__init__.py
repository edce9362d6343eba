"""Standalone ZeroMQ teacher server: scores student rollouts with the teacher's top-k logprobs."""
