"""Watching a run: its metric rows, plots, console lines, the divergence watch and the wandb guard."""
