"""Running a run: the actor and rollout pools (on Ray or in-process), the Ray cluster, the watchdog, stop signals, checkpoints, export and model pins.

`python -m recipe_gkd.runtime.export` writes a checkpoint's student as a Hugging Face model directory.
"""
