"""Distillation from a teacher whose tokenizer differs from the student's (algorithm.cross_tokenizer)."""
