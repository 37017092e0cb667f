// The threads of FlagServe's CPU kernels: a work-sharing pool in place of at::parallel_for
// (issue 16).
//
// at::parallel_for is an OpenMP region: the range is cut into one equal part per thread and
// the caller returns when every thread has finished its part. When another process takes one
// of the team's cores (a served engine shares its host with the HTTP replica, Ray and the
// client), the thread that lost its core holds up the whole op, and the next, for the
// scheduler's time slice: a competitor taking 1/8 of the machine cost an offline run 35%
// (docs/performance.md, CPU). Here the caller and the helpers take chunks of the range from
// one counter, so whichever thread has a core does the work; the caller waits only for
// chunks already taken, never for a helper that has not started; and a helper that wakes
// after the op has ended finds nothing to take.
//
// Threads: at::get_num_threads() per call (the engine's thread tuner sets it), the caller
// being one of them. Bodies must not throw and must not call parallel_for themselves (a
// nested or concurrent call runs inline).
#pragma once

#include <algorithm>
#include <cstdint>

namespace pool {

using Body = void (*)(const void* ctx, int64_t begin, int64_t end);

// Runs body(ctx, b, e) over [begin, end) in chunks of at least `grain`.
void run(int64_t begin, int64_t end, int64_t grain, Body body, const void* ctx);

// f(b, e) over [begin, end), as at::parallel_for(begin, end, grain, f), but chunks are taken
// dynamically: f is called once per chunk, so per-chunk setup (scratch buffers) belongs in a
// thread_local or is cheap.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  run(begin, end, std::max<int64_t>(grain, 1),
      [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
}

}  // namespace pool
