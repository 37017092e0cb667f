// Walking one sequence's blocks of the paged cache, for the CPU attention kernels
// (cpu_paged_attention.cpp, cpu_paged_prefill.cpp). `L` is a kernel's view of the cache:
// block_size, block_stride, token_stride and head_dim, in elements.
#pragma once

#include <algorithm>
#include <cstdint>

namespace paged {

// Asks for a block's rows of one head (`rows` points at its first) to be brought into L2.
// Blocks are scattered, so the hardware prefetcher loses the stream at every block boundary:
// asking for the next block while this one is read made decode attention over 64 sequences
// of 200-400 tokens 1.6x faster (12-13 -> 20 GB/s of K/V; K alone 1.3x). Where the rows
// are whole (head_dim spans the row: every KV head) the block is one run, and the start of
// each 4 KB page of it is enough for the prefetcher to follow: a prefetch per line filled
// the miss queue (17 vs 22 GB/s on a read-only walk of SmolLM2's cache, 2 Zen 3 cores).
template <typename T, typename L>
inline void prefetch_rows(const T* rows, const L& l) {
  constexpr int64_t line = 64 / sizeof(T), page = 4096 / sizeof(T);
  if (l.head_dim == l.token_stride) {
    for (int64_t e = 0; e < l.block_size * l.token_stride; e += page) {
      __builtin_prefetch(rows + e, 0, 2);
      __builtin_prefetch(rows + e + line, 0, 2);
    }
    return;
  }
  for (int64_t i = 0; i < l.block_size; ++i)
    for (int64_t d = 0; d < l.head_dim; d += line)
      __builtin_prefetch(rows + i * l.token_stride + d, 0, 2);
}

// f(first token, offset of its row, rows) for each block of cached positions [0, len);
// with `head` (the cache at this head's first row), the next block is prefetched first.
template <typename L, typename F, typename T = float>
inline void for_blocks(const int32_t* table, int64_t len, const L& l, F&& f,
                       const T* head = nullptr) {
  for (int64_t start = 0, b = 0; start < len; start += l.block_size, ++b) {
    if (head != nullptr && start + l.block_size < len) prefetch_rows(head + table[b + 1] * l.block_stride, l);
    f(start, table[b] * l.block_stride, std::min(l.block_size, len - start));
  }
}

// Rows read ahead per run of blocks, at most: a run must stay in L2 (512 KB a core on the
// smallest CPU measured) while a pass computes on it.
constexpr int64_t kReadAheadBytes = 128 * 1024;

// Reads one byte of every cache line of blocks [b0, b1) whose rows are whole: a sequential
// read, which the hardware prefetcher streams at the memory's full rate.
template <typename T, typename L>
inline void read_ahead(const T* cache, const int32_t* table, int64_t b0, int64_t b1, const L& l) {
  const int64_t bytes = l.block_size * l.token_stride * static_cast<int64_t>(sizeof(T));
  unsigned sink = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const auto* p = reinterpret_cast<const unsigned char*>(cache + table[b] * l.block_stride);
    for (int64_t e = 0; e < bytes; e += 64) sink |= p[e];
  }
  asm volatile("" : : "r"(sink));  // the reads are the point: keep them
}

// for_blocks for a pass over whole rows (every KV head of the cache at `cache`): each run of
// blocks is read ahead first, then computed on from L2. A kernel's own reads, interleaved with
// its arithmetic, do not overlap with the misses: decode attention over 64 sequences of
// 200-400 tokens ran at ~11 GB/s against ~19 for a bare read of the same blocks, ~13 like
// this, and software prefetches of the next blocks did not close it (docs/performance.md,
// CPU; an Intel Xeon).
template <typename L, typename F, typename T>
inline void for_blocks_read_ahead(const int32_t* table, int64_t len, const L& l, F&& f,
                                  const T* cache) {
  const int64_t block_bytes = l.block_size * l.token_stride * static_cast<int64_t>(sizeof(T));
  const int64_t run = std::max<int64_t>(1, kReadAheadBytes / block_bytes);
  const int64_t blocks = (len + l.block_size - 1) / l.block_size;
  for (int64_t b0 = 0; b0 < blocks; b0 += run) {
    const int64_t b1 = std::min(blocks, b0 + run);
    read_ahead(cache, table, b0, b1, l);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * l.block_size;
      f(start, table[b] * l.block_stride, std::min(l.block_size, len - start));
    }
  }
}

}  // namespace paged
