#!/usr/bin/env bash
# Checks the kernels' software FP8 E4M3 conversions (kernels/dtype.cuh: what sm_80 and
# the emulation run) against NVIDIA's host reference of the sm_89+ instructions the
# kernels use on newer GPUs (cuda_fp8.hpp), exhaustively: 256 codes, 2^32 f32 inputs
# (about 30 s). With no GPU anywhere, this is the evidence that the two paths of
# dtype.cuh agree. Needs g++ (C++17) and CUDA's include directory (cuda_fp8.h):
# $CUDA_INCLUDE, else next to $NVCC, else target/cuda-toolchain's (what .ci/cuda installs).
#
# Usage: check.sh [build dir, default target/fp8-reference]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${1:-$root/target/fp8-reference}
include=${CUDA_INCLUDE:-}
if [ -z "$include" ]; then
  for dir in "$(dirname "${NVCC:-/nonexistent/bin/nvcc}")/../include" \
             "$root/target/cuda-toolchain/nvidia/cu13/include"; do
    [ -f "$dir/cuda_fp8.h" ] && include=$dir && break
  done
fi
[ -f "$include/cuda_fp8.h" ] || { echo "check.sh: no cuda_fp8.h (set CUDA_INCLUDE)" >&2; exit 2; }
mkdir -p "$out"
cxx=${CXX:-g++}
"$cxx" -std=c++17 -O2 -Wall -Wextra -Werror -I "$here/../../kernels" -c "$here/kvp_side.cpp" -o "$out/kvp_side.o"
"$cxx" -std=c++17 -O2 -I "$include" -c "$here/nv_side.cpp" -o "$out/nv_side.o"
"$cxx" "$out/kvp_side.o" "$out/nv_side.o" -o "$out/fp8-reference"
"$out/fp8-reference"
