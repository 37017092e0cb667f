// The work-sharing pool of cpu_pool.h: why it replaces at::parallel_for is said there.
#include "cpu_pool.h"

#include <ATen/Parallel.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pool {
namespace {

// The ticket: generation | chunk count | next chunk, one word, so that a chunk is taken with
// one compare-and-swap and a helper can never take a chunk of a job that has ended (its
// count is exhausted) or read another job's count.
constexpr int kIdxBits = 20, kCountBits = 20;
constexpr uint64_t kIdxMask = (uint64_t{1} << kIdxBits) - 1;
constexpr uint64_t kCountMask = (uint64_t{1} << kCountBits) - 1;
constexpr uint64_t kGenMask = (uint64_t{1} << (64 - kIdxBits - kCountBits)) - 1;
// Chunks per thread: enough that a thread which loses its core mid-op holds up the others by
// one small chunk, few enough that taking them costs nothing (one atomic per chunk).
constexpr int64_t kChunksPerThread = 16;
// How long an idle helper spins before it sleeps: longer than the gap between a step's ops
// (tens of us of Python), far shorter than a scheduler time slice, like the engine's
// GOMP_SPINCOUNT (flagserve/engine/cpu_runtime.py). One pause is ~25 ns on Zen 4.
constexpr int kSpinPauses = 4000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

thread_local bool t_in_pool = false;  // a helper, or a caller inside run(): nested calls inline

inline uint64_t idx_of(uint64_t t) { return t & kIdxMask; }
inline uint64_t count_of(uint64_t t) { return (t >> kIdxBits) & kCountMask; }

class Pool {
 public:
  void run(int64_t begin, int64_t end, int64_t grain, Body body, const void* ctx) {
    const int64_t threads = at::get_num_threads(), n = end - begin;
    if (threads <= 1 || n <= grain || t_in_pool || !submit_.try_lock()) {
      body(ctx, begin, end);
      return;
    }
    std::lock_guard<std::mutex> hold(submit_, std::adopt_lock);
    ensure_helpers(static_cast<int>(threads - 1));
    // At most `target` chunks, so the count fits its bits whatever the thread count.
    const int64_t target = std::min<int64_t>(threads * kChunksPerThread, kCountMask);
    const int64_t chunk = std::max<int64_t>(grain, (n + target - 1) / target);
    const uint64_t count = static_cast<uint64_t>((n + chunk - 1) / chunk);
    job_ = Job{body, ctx, begin, end, chunk};
    done_.store(0, std::memory_order_relaxed);
    active_.store(static_cast<int>(threads - 1), std::memory_order_relaxed);
    gen_ = (gen_ + 1) & kGenMask;
    ticket_.store(gen_ << (kIdxBits + kCountBits) | count << kIdxBits, std::memory_order_seq_cst);
    // Not under sleep_mutex_: a helper that lost its core holding it must not stall the op.
    // A helper between its last look and its wait misses this job (the caller does it).
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_.notify_all();
    t_in_pool = true;
    work();
    // Only chunks a helper has taken are waited for; one that never woke is not. Past the
    // spin, yield: a helper that shares this core (more threads than cores) needs it back.
    for (int i = 0; done_.load(std::memory_order_acquire) < static_cast<int64_t>(count); ++i) {
      if (i < kSpinPauses) cpu_relax(); else sched_yield();
    }
    t_in_pool = false;
  }

  // In a forked child the helpers do not exist: start afresh (the parent's are untouched).
  void after_fork_in_child() {
    new (&submit_) std::mutex();
    new (&sleep_mutex_) std::mutex();
    new (&wake_) std::condition_variable();
    helpers_ = 0;
    sleepers_.store(0);
    ticket_.store(0);
  }

 private:
  struct Job {
    Body body;
    const void* ctx;
    int64_t begin, end, chunk;
  };

  // Takes and runs chunks of the published job until none is left. The job's fields are read
  // after a chunk is taken: the caller cannot publish the next job before that chunk is done.
  void work() {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while (idx_of(t) < count_of(t)) {
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      const Job& j = job_;
      const int64_t b = j.begin + static_cast<int64_t>(idx_of(t)) * j.chunk;
      j.body(j.ctx, b, std::min(j.end, b + j.chunk));
      done_.fetch_add(1, std::memory_order_acq_rel);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  bool has_work(int id) const {
    const uint64_t t = ticket_.load(std::memory_order_seq_cst);  // against run()'s sleepers_ load
    return idx_of(t) < count_of(t) && id < active_.load(std::memory_order_relaxed);
  }

  void helper(int id) {
    t_in_pool = true;
    for (;;) {
      for (int i = 0; i < kSpinPauses && !has_work(id); ++i) cpu_relax();
      if (!has_work(id)) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return has_work(id); });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      work();
    }
  }

  // The cores of helper `id`: the OpenMP place after the caller's, wrapping (the engine binds
  // its OpenMP threads one per owned core; a thread started here would otherwise inherit the
  // caller's single core). Unbound callers start unbound helpers.
  static std::vector<int> cpus_of(int id) {
    const int places = omp_get_num_places(), mine = omp_get_place_num();
    if (places < 2 || mine < 0) return {};
    const int place = (mine + 1 + id) % places;
    std::vector<int> ids(omp_get_place_num_procs(place));
    omp_get_place_proc_ids(place, ids.data());
    return ids;
  }

  void ensure_helpers(int wanted) {
    for (; helpers_ < wanted; ++helpers_) {
      std::thread t(&Pool::helper, this, helpers_);
      pthread_setname_np(t.native_handle(), "flagserve-cpu");  // how ps, top and tests find it
      if (const std::vector<int> cpus = cpus_of(helpers_); !cpus.empty()) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int c : cpus) CPU_SET(c, &set);
        pthread_setaffinity_np(t.native_handle(), sizeof(set), &set);
      }
      t.detach();  // the pool lives as long as the process and is never destroyed
    }
  }

  Job job_{};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> active_{0};  // helpers that may take chunks: the call's threads - 1
  std::atomic<int> sleepers_{0};
  std::mutex submit_;  // one job at a time; a concurrent caller runs its op inline
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  int helpers_ = 0;
  uint64_t gen_ = 0;
};

Pool& instance() {
  // Leaked on purpose: detached helpers may still be spinning at exit.
  static Pool* pool = [] {
    auto* p = new Pool();
    pthread_atfork(nullptr, nullptr, [] { instance().after_fork_in_child(); });
    return p;
  }();
  return *pool;
}

}  // namespace

void run(int64_t begin, int64_t end, int64_t grain, Body body, const void* ctx) {
  instance().run(begin, end, grain, body, ctx);
}

}  // namespace pool
