/*
 * Software prefetches the compiler keeps, for the CPU kernels of this folder. GCC 12 at -O3
 * deletes __builtin_prefetch (and _mm_prefetch) where it sits under a runtime condition or in a
 * loop of nothing else (measured: the attention kernel's hints compiled to no instruction at
 * all). An asm statement marked volatile is never deleted: these always ask.
 *
 * Semantics: each asks for the cache line holding p to be brought closer; it never faults,
 * whatever p points to, and changes no value.
 *   prefetch_line   into every cache level (x86's T0 hint): for lines needed soon that the
 *                   hardware prefetchers mostly bring into L2 already (the attention kernel's
 *                   next block where it transposes keys: its loads then find them in L1).
 *   prefetch_to_l2  into L2 and beyond, not L1 (the T2 hint): for streams the hardware
 *                   prefetchers do not follow, so each line comes from memory. A T0 ask holds
 *                   one of L1's few miss buffers until the line arrives, which caps a core's
 *                   reads from memory; an L2 ask does not (Zen 3: scattered 12 KB blocks read
 *                   at 12 GB/s with T0 asks one block ahead, 20-24 GB/s with T2). A decode's
 *                   attention asks this way alone (Zen 4: the T0 asks on top cost it time).
 */

#pragma once

namespace vllm_cpu_bits {

inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pldl1keep, %0" : : "Q"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

inline void prefetch_to_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pldl2keep, %0" : : "Q"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

}  // namespace vllm_cpu_bits
