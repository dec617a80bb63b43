/*
 * The memory read rate the benchmarks' floors divide bytes by, measured the way this engine's
 * decode kernels read weights: each thread's share of a buffer read as `streams` sequential
 * streams pages apart, interleaved 256 bytes at a time. Built and loaded by
 * benchmarks/common.py (never by the engine).
 *
 * Why: torch's sum reads one sequential stream per thread. On a Zen 3 core one stream ran at
 * 10-12 GB/s and four to eight streams pages apart at 15-17 (the hardware prefetchers keep more
 * lines in flight), so the dense GEMV, which reads tiles of rows pages apart, outran a floor
 * taken from torch's sum (0.93x of it). The floor is the faster of the two.
 *
 * Semantics: stream_sum(x, streams) = the sum of every element of x (fp32, contiguous), in an
 * order fixed by the thread split and `streams` (a floating-point sum: equal to x.sum() up to
 * rounding). Each thread reads its range [b, e) as `streams` parts of equal length, chunk c of
 * every part before chunk c + 1 of any; the elements past the last whole chunk of the parts are
 * read after them, in order.
 */

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kChunk = 64;  // floats (256 bytes) a stream advances by before the next one

float range_sum(const float* x, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += x[i];
  return acc;
}

// [b, e) of x read as `streams` interleaved streams.
double streams_sum(const float* x, int64_t b, int64_t e, int64_t streams) {
  const int64_t part = (e - b) / streams / kChunk * kChunk;
  double total = 0.0;
  for (int64_t off = 0; off < part; off += kChunk)
    for (int64_t s = 0; s < streams; ++s) total += range_sum(x + b + s * part + off, kChunk);
  return total + range_sum(x + b + streams * part, e - b - streams * part);
}

double stream_sum(const at::Tensor& x, int64_t streams) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32");
  TORCH_CHECK(streams >= 1, "streams must be at least 1, got ", streams);
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel(), threads = at::get_num_threads();
  std::vector<double> partial(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) partial[t] = streams_sum(p, n * t / threads, n * (t + 1) / threads, streams);
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

}  // namespace

TORCH_LIBRARY(vllm_bench, m) { m.def("stream_sum(Tensor x, int streams) -> float"); }

TORCH_LIBRARY_IMPL(vllm_bench, CPU, m) { m.impl("stream_sum", TORCH_FN(stream_sum)); }
