#!/usr/bin/env bash
# Wheels for a GPU node without registry access, downloaded on a connected machine (any OS, any Python).
#
#   launch/gpu_wheels.sh DIR [--python 3.12] [--vllm 0.24.0] [--torch VERSION (default: the one vLLM pins)]
#
# The node already has the torch the vLLM release pins (0.24.0: 2.11.0, 0.33.0: 2.14.0) and Python 3.12: every other
# package the GPU stack needs (vllm, ray, megatron-core, pyzmq, msgspec, omegaconf, ... and their
# dependencies) is resolved for that Python and manylinux x86_64, then downloaded into DIR; torch and
# the CUDA libraries that come with it (nvidia-*, triton) are left out. On the node, from this checkout:
#
#   pip install --no-index --find-links DIR -e '.[vllm]'
#
# (`--no-index`: nothing but DIR is read). DIR also gets requirements-gpu.txt, the exact pins resolved.
set -euo pipefail

usage() { sed -n '2,13p' "$0"; exit 2; }
[[ $# -ge 1 && "$1" != -* ]] || usage
DIR=$1; shift
PYVER=3.12 VLLM=0.24.0 TORCH=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --python) PYVER=$2; shift 2 ;;
    --vllm) VLLM=$2; shift 2 ;;
    --torch) TORCH=$2; shift 2 ;;
    *) usage ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$DIR"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Every manylinux level a current x86_64 node accepts (pip matches the tags exactly).
PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
TARGET=(--only-binary=:all: --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}")

# The torch this vLLM release pins, read from its wheel's METADATA (launch/torch_pin.py); the wheel is one
# of those DIR gets anyway. --torch, where given, must be that release: vLLM installs against nothing else.
$PY -m pip download --quiet --no-deps "${TARGET[@]}" -d "$DIR" "vllm==$VLLM"
PIN=$($PY "$ROOT/launch/torch_pin.py" "$(ls "$DIR"/vllm-"$VLLM"-*.whl | head -n 1)")
if [[ -z "$TORCH" ]]; then
  TORCH=$PIN
elif [[ "$TORCH" != "$PIN" ]]; then
  echo "--torch $TORCH: vllm $VLLM pins torch==$PIN (its wheel's METADATA); leave --torch out or pass $PIN" >&2
  exit 2
fi

# The project's own dependencies as pyproject.toml declares them, the vLLM release, and the build backend
# (`pip install -e .` builds with setuptools, from DIR too).
$PY - "$ROOT/pyproject.toml" "$VLLM" "$TORCH" > "$WORK/wanted.txt" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for dep in project["dependencies"]:
    name = re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0].lower()
    if name != "torch":  # the node's own, pinned below
        print(dep)
print(f"vllm=={sys.argv[2]}")
print("setuptools>=68")
print("wheel")
EOF
# The node's torch stands in the resolution as an empty wheel of the same release with a local version
# (2.11.0+preinstalled satisfies vllm's torch==2.11.0 and sorts above the index's 2.11.0): torch's own
# dependencies (CUDA libraries, triton) are never resolved nor downloaded.
mkdir -p "$WORK/stub"
$PY - "$WORK/stub" "$TORCH" <<'EOF'
import base64, hashlib, sys, zipfile
out, version = sys.argv[1], sys.argv[2] + "+preinstalled"
info = f"torch-{version}.dist-info"
files = {
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu_wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
def digest(text):
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
record = "".join(f"{n},sha256={digest(t)},{len(t)}\n" for n, t in files.items()) + f"{info}/RECORD,,\n"
with zipfile.ZipFile(f"{out}/torch-{version}-py3-none-any.whl", "w") as wheel:
    for name, text in {**files, f"{info}/RECORD": record}.items():
        wheel.writestr(name, text)
EOF
echo "resolving for Python $PYVER, vllm $VLLM, torch $TORCH (preinstalled on the node) ..."
$PY -m pip install --quiet --dry-run --ignore-installed --report "$WORK/report.json" --target "$WORK/target" \
  "${TARGET[@]}" --find-links "$WORK/stub" -r "$WORK/wanted.txt" "torch==$TORCH+preinstalled"
# Everything resolved but torch and what ships with it on the node.
$PY - "$WORK/report.json" > "$DIR/requirements-gpu.txt" <<'EOF'
import json, re, sys
PREINSTALLED = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    name = meta["name"].lower().replace("_", "-")
    if not PREINSTALLED.match(name):
        print(f"{name}=={meta['version']}")
EOF
echo "downloading $(wc -l < "$DIR/requirements-gpu.txt") wheels into $DIR ..."
$PY -m pip download --quiet --no-deps "${TARGET[@]}" -d "$DIR" -r "$DIR/requirements-gpu.txt"
echo "$(du -sh "$DIR" | cut -f1) in $DIR; on the node: pip install --no-index --find-links $DIR -e '.[vllm]'"
