// PLACEHOLDER of the cuda-device branch, to be dropped at merge: a kernel for the
// device-side smoke test until the KERNELS helper's kernels land.
extern "C" __global__ void kvp_device_placeholder_fill(float* p, float v, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
