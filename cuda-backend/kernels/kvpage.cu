// The kvpage kernels: one translation unit, one fatbin (names and launch contracts in
// params.h). Also compiled as host C++ by host/emulation_entry.cpp for the emulated tests.
//
// Checked with (no spills, no stack frame), one command line:
//   $NVCC -fatbin -gencode arch=compute_80,code=sm_80 -gencode arch=compute_89,code=sm_89
//     -gencode arch=compute_90,code=[sm_90,compute_90] -Xptxas -v -Werror all-warnings
//     -o kvpage.fatbin cuda-backend/kernels/kvpage.cu
// Never with --use_fast_math / -prec-div=false: the 8-bit write divides by the row's
// scale and must round exactly as the CPU backend does (bit-exact codes).
#include "compat.cuh"

#include "attention.cuh"
#include "copy.cuh"
#include "write.cuh"
