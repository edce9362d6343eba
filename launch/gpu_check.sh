#!/usr/bin/env bash
# The GPU self-check for a bare GPU machine: Python 3.12, torch and transformers installed, nothing else of the
# stack, no network, a few MiB carried per call. Stage 0 needs only the small wheels in launch/gpu_check_wheels.json.
#
#   launch/gpu_check.sh prepare DIR [--python 3.12]   # connected machine: download the wheels into DIR/wheels
#   launch/gpu_check.sh run DIR OUT [--budget-s 420] [--only NAME,...]  # GPU machine: install, run stage 0 -> OUT
#   launch/gpu_check.sh check DIR                      # the size rule alone (DIR + the working tree <= 60 MiB)
#   launch/gpu_check.sh split SRC PARTS [--part-mib 32] # stage 1: SRC's files as numbered parts + SHA256SUMS
#   launch/gpu_check.sh join PARTS DEST                # stage 1, on the machine: every part checked, SRC rebuilt
#
# prepare: `pip download --no-deps --only-binary=:all:` of exactly the pins in launch/gpu_check_wheels.json for
# that Python on manylinux x86_64; at the recorded Python each file must match its recorded sha256. It refuses,
# naming the largest files, when DIR plus the repository's tracked files exceed 60 MiB (what travels in one call).
# run: `pip install --no-index --no-deps --target DIR/site` (skipped when DIR/site is current), then
# `python -m recipe_gkd.selfcheck --stage 0` with PYTHONPATH=repo:DIR/site under a `timeout` of the budget + 60 s,
# models built once under DIR/models (kept between warm calls: a rerun skips building them).
# Keep DIR under the git-ignored .gpu_carry/ so it travels beside the working tree.
#
# Stage 1 (Ray and vLLM; planned, not run yet). Each call carries the working tree (~25 MiB) plus what `carry`
# names, 64 MiB in all: a part is at most 60 - tree = ~32 MiB (`split` refuses more). Measured for Python 3.12,
# vLLM 0.24.0, torch 2.11.0 (docs/gpu_splits.md): the whole GPU stack is 176 wheels, 1.3 GB, the largest
# flashinfer-cubin 427 MB, vllm 267 MB, ray 76 MB; stage 0's <out>/image_packages.txt says what the image has.
# Order and minutes (15 device minutes per session, the machine's start ~2 min counted; ignored files stay
# on the machine while it is warm, so parts accumulate over consecutive calls):
#   0. here: launch/gpu_wheels.sh DIR1 resolves the stack; drop what image_packages.txt holds, and
#      flashinfer-* (vLLM's FLASH_ATTN backend ships inside the vllm wheel: run with VLLM_ATTENTION_BACKEND=
#      FLASH_ATTN, VLLM_USE_FLASHINFER_SAMPLER=0; reasoned, not measured); expect vllm + ray + ~40 small
#      wheels, ~400 MB; `split DIR1 .gpu_carry/parts` -> ~13 parts of 32 MiB, each with its sha256.
#   1. session A (this script's `run`): stage 0 only, ~1 min start + <= 8 min, a rerun of the failed checks
#      (--only) if it fits. Stage 1 does not fit beside it. Measured on one H200: the call 80 s for the ten checks
#      before the learning ones (start ~50 s), learn_demo 26 s, learn_tools 98 s. Where a machine returns only a
#      few files, write OUT elsewhere and pack it: `run DIR /tmp/s0; tar czf "$OUT/stage0.tgz" -C /tmp s0`.
#   2. session B: one call per part, carry=[".gpu_carry/parts/part.NNN", ".gpu_carry/parts/SHA256SUMS"],
#      command `ls -l .gpu_carry/parts` (measure the first call's seconds: ~20-30 s each is the guess,
#      13 parts ~6 min); never pause over ~25 s between calls (the machine goes back when idle);
#   3. then `join .gpu_carry/parts .gpu_carry/stage1`, `pip install --no-index --no-deps --target
#      .gpu_carry/site1 .gpu_carry/stage1/*.whl` (~1 min), and with PYTHONPATH=repo:.gpu_carry/site:.gpu_carry/site1
#      `python -m recipe_gkd.selfcheck --stage 1 --only colocated_vllm --steps 3` (the one-GPU preset with
#      random weights built offline, ~3-4 min, vLLM's engine start dominating): ~2 + 6 + 1 + 4 = ~13 min.
#   A part lost (the machine went back between calls) shows in `join` ("missing part.NNN"): start over.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
RECORD=$ROOT/launch/gpu_check_wheels.json
LIMIT_MIB=60
STAGE0_BUDGET_S=420

usage() { sed -n '2,10p' "$0"; exit 2; }

# The tracked files' bytes (what the device tool copies of the working tree) plus DIR's; refuse over the limit.
size_rule() {
  local dir=$1
  "$PY" "$ROOT/launch/gpu_check_size.py" --root "$ROOT" --carry "$dir" --limit-mib "$LIMIT_MIB"
}

prepare() {
  local dir=$1; shift
  local pyver
  pyver=$("$PY" "$ROOT/launch/gpu_check_size.py" --recorded-python "$RECORD")
  while [[ $# -gt 0 ]]; do
    case $1 in
      --python) pyver=$2; shift 2 ;;
      *) usage ;;
    esac
  done
  mkdir -p "$dir/wheels"
  local pins
  pins=$("$PY" "$ROOT/launch/gpu_check_size.py" --pins "$RECORD")
  local start=$SECONDS
  # shellcheck disable=SC2086
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$pyver" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$dir/wheels" $pins
  echo "downloaded for Python $pyver in $((SECONDS - start)) s: $pins"
  "$PY" "$ROOT/launch/gpu_check_size.py" --verify "$RECORD" --carry "$dir" --python "$pyver"
  size_rule "$dir"
}

run() {
  local dir out budget=$STAGE0_BUDGET_S only=()
  dir=$(cd "$1" && pwd); out=$2; shift 2
  while [[ $# -gt 0 ]]; do
    case $1 in
      --budget-s) budget=$2; shift 2 ;;
      --only) only=(--only "$2"); shift 2 ;;
      *) usage ;;
    esac
  done
  mkdir -p "$out"
  local stamp="$dir/site/.installed"
  local want
  want=$(cd "$dir/wheels" && ls -1 ./*.whl | sort | tr '\n' ' ')
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    local start=$SECONDS
    rm -rf "$dir/site"
    if "$PY" -m pip --version > /dev/null 2>&1; then
      "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$dir/site" "$dir"/wheels/*.whl
    else
      # An image without pip: these wheels carry no scripts or data directories, so unpacking is their install.
      for wheel in "$dir"/wheels/*.whl; do "$PY" -m zipfile -e "$wheel" "$dir/site"; done
    fi
    echo "$want" > "$stamp"
    echo "installed $(ls "$dir"/wheels | wc -l) wheels into $dir/site in $((SECONDS - start)) s"
  fi
  export PYTHONPATH="$ROOT:$dir/site${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  # The outer bound: the budget decides which checks start; a check that hangs is cut here, and the record
  # written after each finished check stays.
  local rc=0
  timeout --kill-after=10 "$((budget + 60))" "$PY" -m recipe_gkd.selfcheck --stage 0 --out "$out" \
    --models "$dir/models" --budget-s "$budget" "${only[@]}" || rc=$?
  [[ $rc -eq 124 || $rc -eq 137 ]] && echo "stage 0 stopped by its timeout ($((budget + 60)) s); the record holds what finished" >&2
  return $rc
}

# Stage 1's transfer: SRC's files (wheels: zip-compressed already) in one uncompressed tar stream, cut into
# PARTS/part.NNN of at most --part-mib each; PARTS/SHA256SUMS holds every part's hash and the whole stream's.
split_parts() {
  local src=$1 parts=$2; shift 2
  local part_mib=32
  while [[ $# -gt 0 ]]; do
    case $1 in
      --part-mib) part_mib=$2; shift 2 ;;
      *) usage ;;
    esac
  done
  [[ -d "$src" ]] || { echo "split: no directory $src" >&2; exit 2; }
  # A part travels with the working tree in one call: both within the limit.
  local tree_mib
  tree_mib=$("$PY" "$ROOT/launch/gpu_check_size.py" --root "$ROOT" --tree-mib)
  if "$PY" -c 'import sys; sys.exit(float(sys.argv[1]) + float(sys.argv[2]) <= float(sys.argv[3]))' \
      "$part_mib" "$tree_mib" "$LIMIT_MIB"; then
    echo "split: parts of $part_mib MiB + the working tree's $tree_mib MiB exceed $LIMIT_MIB MiB; pass a smaller --part-mib" >&2
    exit 2
  fi
  mkdir -p "$parts"
  rm -f "$parts"/part.* "$parts/SHA256SUMS"
  # Bytes, not MiB units of split's own: --part-mib may be fractional (the suite cuts kilobytes).
  local bytes
  bytes=$("$PY" -c 'import sys; print(max(1, int(float(sys.argv[1]) * 2**20)))' "$part_mib")
  tar -C "$src" -cf - . | split -d -a 3 -b "$bytes" - "$parts/part."
  # Each part's hash, and the joined stream's (a part out of order or from another split fails it).
  (cd "$parts" && sha256sum part.* && cat part.* | sha256sum | awk '{print $1 "  whole"}') > "$parts/SHA256SUMS.tmp"
  mv "$parts/SHA256SUMS.tmp" "$parts/SHA256SUMS"
  echo "split $(du -sb "$src" | cut -f1) bytes of $src into $(ls "$parts"/part.* | wc -l) parts of <= $part_mib MiB"
}

join_parts() {
  local parts=$1 dest=$2
  [[ -f "$parts/SHA256SUMS" ]] || { echo "join: no $parts/SHA256SUMS (split writes it)" >&2; exit 2; }
  local missing=()
  while read -r _ name; do
    [[ $name == whole ]] && continue
    [[ -f "$parts/$name" ]] || missing+=("$name")
  done < "$parts/SHA256SUMS"
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "join: missing ${missing[*]} (carry each one in a call of its own)" >&2
    exit 1
  fi
  (cd "$parts" && grep -v '  whole$' SHA256SUMS | sha256sum --check --quiet) || { echo "join: a part is damaged" >&2; exit 1; }
  local whole
  whole=$(cat "$parts"/part.* | sha256sum | cut -d' ' -f1)
  [[ "$whole" == "$(awk '$2 == "whole" {print $1}' "$parts/SHA256SUMS")" ]] || { echo "join: the joined stream differs" >&2; exit 1; }
  mkdir -p "$dest"
  cat "$parts"/part.* | tar -C "$dest" -xf -
  echo "joined $(ls "$parts"/part.* | wc -l) parts into $dest"
}

[[ $# -ge 2 ]] || usage
cmd=$1; shift
case $cmd in
  prepare) prepare "$@" ;;
  run) [[ $# -ge 2 ]] || usage; run "$@" ;;
  check) size_rule "$1" ;;
  split) [[ $# -ge 2 ]] || usage; split_parts "$@" ;;
  join) [[ $# -ge 2 ]] || usage; join_parts "$@" ;;
  *) usage ;;
esac
