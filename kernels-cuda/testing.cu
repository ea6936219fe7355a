// Kernels for tests of the runtime itself (not of any op).
#include "common.cuh"

// Spins for `cycles` clock cycles on one thread per CTA, then writes its CTA index: two
// of these on two streams show whether streams really run at once.
ERASE_KERNEL void erase_spin(long long cycles, int* out) { ERASE_PDL_ENTER();
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
    if (threadIdx.x == 0) out[blockIdx.x] = blockIdx.x;
}
