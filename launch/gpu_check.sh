#!/usr/bin/env bash
# The GPU self-check for a bare GPU machine: Python 3.12, torch and transformers installed, nothing else of the
# stack, no network, a few MiB carried per call. Stage 0 needs only the small wheels in launch/gpu_check_wheels.json.
#
#   launch/gpu_check.sh prepare DIR [--python 3.12]   # connected machine: download the wheels into DIR/wheels
#   launch/gpu_check.sh run DIR OUT [--budget-s 330]   # GPU machine: install them into DIR/site, run stage 0 -> OUT
#   launch/gpu_check.sh check DIR                      # the size rule alone (DIR + the working tree <= 60 MiB)
#   launch/gpu_check.sh split SRC PARTS [--part-mib 55] # stage 1: SRC's files as numbered parts + SHA256SUMS
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
# Stage 1 (Ray and vLLM; planned, not run yet). Ray's wheel (~79 MB) and vLLM's (~300-400 MB) cannot travel in
# one call of 64 MiB. Plan, on a machine that stays warm between calls (ignored files are kept while warm, ~30 s
# idle after each call; 15 device minutes in all, its start included):
#   0. here: `pip download` ray==2.60.0, vllm (the release that pins the image's torch: 0.24.0 pins 2.11.0) and
#      their missing dependencies for 3.12 (launch/gpu_wheels.sh resolves them); `split` them into numbered
#      parts of 55 MiB (split -b 55M) with a sha256 list; expect ~8 parts (~440 MB), so ~8 calls.
#   1. stage 0 first (one call of ~6 min plus the machine's start, ~2 min; a rerun only if it failed);
#   2. then only with >= 8 minutes left: one call per part, each copying its part from the carry to
#      DIR/parts/ (a call of ~20-40 s each, the transfer dominating: measure it on the first one);
#   3. `join`: cat the parts, check each sha256, `pip install --no-index --no-deps --target DIR/site1` (~60 s);
#   4. `python -m recipe_gkd.selfcheck --stage 1 --only colocated_vllm --steps 3` (1x1_colocated, random weights,
#      ~3-4 min: vLLM's engine start dominates) with PYTHONPATH=repo:DIR/site:DIR/site1.
#   Budget: start 2 + stage 0 6 + 8 parts x 0.5 + join/install 1 + stage 1 4 = ~17 min > 15: stage 1 needs its own
#   session (start 2 + parts 4 + install 1 + run 4 = ~11 min), or a smaller vLLM part set.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
RECORD=$ROOT/launch/gpu_check_wheels.json
LIMIT_MIB=60
STAGE0_BUDGET_S=330

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
  local dir out budget=$STAGE0_BUDGET_S
  dir=$(cd "$1" && pwd); out=$2; shift 2
  while [[ $# -gt 0 ]]; do
    case $1 in
      --budget-s) budget=$2; shift 2 ;;
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
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$dir/site" "$dir"/wheels/*.whl
    echo "$want" > "$stamp"
    echo "installed $(ls "$dir"/wheels | wc -l) wheels into $dir/site in $((SECONDS - start)) s"
  fi
  export PYTHONPATH="$ROOT:$dir/site${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  # The outer bound: the budget decides which checks start; a check that hangs is cut here, and the record
  # written after each finished check stays.
  local rc=0
  timeout --kill-after=10 "$((budget + 60))" "$PY" -m recipe_gkd.selfcheck --stage 0 --out "$out" \
    --models "$dir/models" --budget-s "$budget" || rc=$?
  [[ $rc -eq 124 || $rc -eq 137 ]] && echo "stage 0 stopped by its timeout ($((budget + 60)) s); the record holds what finished" >&2
  return $rc
}

# Stage 1's transfer: SRC's files (wheels: zip-compressed already) in one uncompressed tar stream, cut into
# PARTS/part.NNN of at most --part-mib each; PARTS/SHA256SUMS holds every part's hash and the whole stream's.
split_parts() {
  local src=$1 parts=$2; shift 2
  local part_mib=55
  while [[ $# -gt 0 ]]; do
    case $1 in
      --part-mib) part_mib=$2; shift 2 ;;
      *) usage ;;
    esac
  done
  [[ -d "$src" ]] || { echo "split: no directory $src" >&2; exit 2; }
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
