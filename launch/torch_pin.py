"""Print the torch release a vLLM wheel pins: its METADATA's `Requires-Dist: torch==X` (stdlib only).

    python launch/torch_pin.py vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl    # 2.14.0

Read from the wheel itself, so any vLLM release gets its own torch (0.24.0 pins 2.11.0, 0.33.0 pins 2.14.0).
"""

from __future__ import annotations

import re
import sys
import zipfile

PIN = re.compile(r"^Requires-Dist: torch\s*==\s*([^\s;,]+)\s*$", re.MULTILINE)


def torch_pin(wheel: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        metadata = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        if len(metadata) != 1:
            raise SystemExit(f"{wheel}: expected one .dist-info/METADATA, found {len(metadata)}")
        text = archive.read(metadata[0]).decode()
    found = PIN.search(text)
    if found is None:
        raise SystemExit(f"{wheel}: its METADATA pins no exact torch release (Requires-Dist: torch==X)")
    return found.group(1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python launch/torch_pin.py VLLM_WHEEL")
    print(torch_pin(sys.argv[1]))
