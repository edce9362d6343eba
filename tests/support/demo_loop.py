"""The demo's real models in `gkd.train` in-process, on a small training set."""

from __future__ import annotations

from pathlib import Path

from recipe_gkd.config import GKDConfig, load_config

PROMPTS = 24  # a small training set: 6 steps of 8 prompts are two epochs


def demo_config(repo_root: Path, run_dir: Path, *overrides: str) -> GKDConfig:
    demo = repo_root / "assets" / "demo"
    return load_config(
        None,
        [
            f"model.student_path={demo / 'student'}",
            f"teacher.model_path={demo / 'teacher'}",
            f"data.train_files=[{demo / 'data' / 'train.jsonl'}]",
            f"data.eval_files=[{demo / 'data' / 'eval.jsonl'}]",
            f"trainer.run_dir={run_dir}",
            "trainer.eval_every=0",
            *overrides,
        ],
    )


def small_config(repo_root: Path, data: Path, run_dir: Path, *overrides: str) -> GKDConfig:
    """The demo's models on the small training set: 8 prompts, 8 new tokens a step, 6 steps (two epochs)."""
    return demo_config(
        repo_root,
        run_dir,
        f"data.train_files=[{data}]",
        "data.train_batch_size=8",
        "actor.micro_batch_size=8",
        "rollout.sampling.max_new_tokens=8",
        "trainer.total_steps=6",
        *overrides,
    )
