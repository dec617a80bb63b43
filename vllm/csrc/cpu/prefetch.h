/*
 * A software prefetch the compiler keeps, for the CPU kernels of this folder. GCC 12 at -O3
 * deletes __builtin_prefetch (and _mm_prefetch) where it sits under a runtime condition or in a
 * loop of nothing else (measured: the attention kernel's hints compiled to no instruction at
 * all). An asm statement marked volatile is never deleted: `prefetch_line` always asks.
 *
 * Semantics: asks for the cache line holding p to be brought into every cache level (the T0
 * hint); never faults, whatever p points to, and changes no value.
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

}  // namespace vllm_cpu_bits
