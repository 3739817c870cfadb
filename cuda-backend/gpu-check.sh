#!/usr/bin/env bash
# The CUDA backend's checks on a real GPU, in two halves.
#
#   cuda-backend/gpu-check.sh build   here, without a GPU: builds the device tests (the
#       ignored ones) and the benchmark with --features cuda (release) against the
#       libcuda stub, and puts them, stripped, into target/gpu-check/ (ignored by git;
#       about 28 MiB) with a manifest.
#   cuda-backend/gpu-check.sh run     on the GPU machine, from a copy of the repository
#       carrying target/gpu-check: runs every ignored test and the benchmark (under five
#       minutes) and prints one table. Needs no cargo, only the NVIDIA driver.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/target/gpu-check

build() {
  local toolchain=$root/target/cuda-toolchain/nvidia/cu13
  if [ -z "${NVCC:-}" ]; then
    [ -x "$toolchain/bin/nvcc" ] || { echo "run .ci/cuda once (installs the toolchain), or set NVCC" >&2; exit 2; }
    export NVCC=$toolchain/bin/nvcc
  fi
  local stub=$root/target/cuda-stub
  [ -f "$stub/lib64/libcuda.so" ] || cuda-backend/tools/libcuda-stub.sh "$stub" "$(dirname "$NVCC")/../include/cuda.h"
  export CUDA_PATH=$stub CUDA_LIBRARY_PATH=$stub KVPAGE_CUDA_STRICT=1
  rm -rf "$out"; mkdir -p "$out"
  { cargo build --release -p kvpage-cuda --features cuda --benches --tests --message-format=json
    # One cache type on both backends: host-std's CPU-vs-CUDA comparison.
    cargo build --release -p kvpage --features cuda --test cuda --message-format=json; } \
    | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    if m["package_id"].find("cuda-backend") < 0 and m["target"]["name"] != "cuda":
        continue
    kind = "bench" if "bench" in m["target"]["kind"] else "test"
    if m["profile"]["test"] or kind == "bench":
        print(kind, m["target"]["name"], m["executable"])
' | sort -u > "$out/manifest.raw"
  : > "$out/manifest"
  while read -r kind name exe; do
    # A test binary without ignored tests has nothing to run on the GPU.
    if [ "$kind" = test ] && ! "$exe" --list --ignored 2>/dev/null | grep -q ': test$'; then
      continue
    fi
    cp "$exe" "$out/$kind-$name"
    strip "$out/$kind-$name"
    echo "$kind $name" >> "$out/manifest"
  done < "$out/manifest.raw"
  rm "$out/manifest.raw"
  if readelf -d "$out"/* 2>/dev/null | grep -q 'NEEDED.*libcuda'; then
    echo "a binary needs libcuda: the driver must be loaded at run time" >&2; exit 1
  fi
  cat "$out/manifest"
  du -sh "$out"
}

run() {
  [ -f "$out/manifest" ] || { echo "no $out/manifest: run 'gpu-check.sh build' first and carry target/gpu-check" >&2; exit 2; }
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  local table=$out/table.txt status=0
  : > "$table"
  while read -r kind name; do
    local log=$out/$kind-$name.log
    if [ "$kind" = test ]; then
      # Only the ignored tests: the others ran in CI already.
      if timeout 240 "$out/$kind-$name" --ignored --test-threads=1 > "$log" 2>&1; then r=ok; else r=FAIL; status=1; fi
      local counts
      counts=$(grep -E '^test result:' "$log" | tail -1 | sed -E 's/.*ok\. |.*FAILED\. //; s/; [0-9]+ measured.*//')
      printf '%-8s %-28s %-5s %s\n' test "$name" "$r" "$counts" >> "$table"
      grep -E '^test .* FAILED|panicked' "$log" | head -20 >> "$table" || true
    else
      if timeout 240 "$out/$kind-$name" > "$log" 2>&1; then r=ok; else r=FAIL; status=1; fi
      printf '%-8s %-28s %-5s\n' bench "$name" "$r" >> "$table"
      sed 's/^/    /' "$log" >> "$table"
    fi
  done < "$out/manifest"
  echo
  echo "==== gpu-check ($SECONDS s)"
  cat "$table"
  exit $status
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
