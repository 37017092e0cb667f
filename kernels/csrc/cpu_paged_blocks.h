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
// of 200-400 tokens 1.6x faster (12-13 -> 20 GB/s of K/V; K alone 1.3x).
template <typename T, typename L>
inline void prefetch_rows(const T* rows, const L& l) {
  constexpr int64_t line = 64 / sizeof(T);
  for (int64_t i = 0; i < l.block_size; ++i)
    for (int64_t d = 0; d < l.head_dim; d += line)
      __builtin_prefetch(rows + i * l.token_stride + d, 0, 2);
}

// Rows read ahead per run of blocks, at most: a run must stay in L2 (512 KB a core on the
// smallest CPU measured) while a pass computes on it.
constexpr int64_t kReadAheadBytes = 128 * 1024;

// Reads one byte of every cache line of blocks [b0, b1) (`bytes` each, whole rows): a
// sequential read, which the hardware prefetcher streams at the memory's full rate.
template <typename T, typename L>
inline void read_ahead(const T* cache, const int32_t* table, int64_t b0, int64_t b1,
                       int64_t bytes, const L& l) {
  unsigned sink = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const auto* p = reinterpret_cast<const unsigned char*>(cache + table[b] * l.block_stride);
    for (int64_t e = 0; e < bytes; e += 64) sink |= p[e];
  }
  asm volatile("" : : "r"(sink));  // the reads are the point: keep them
}

// f(first token, offset of its row, rows) for each block of cached positions [0, len). With
// `head` (the cache at this head's first row) the pass's reads get help. Where its rows are
// whole (head_dim spans the row: every KV head) each run of blocks is read ahead first, then
// computed on from L2: a kernel's own reads, interleaved with its arithmetic, do not overlap
// their misses (decode attention over 64 sequences of 200-400 tokens read ~11 GB/s against
// ~19 for a bare read of the same blocks, ~13 like this; prefetching the next block, a line
// or a page start at a time, did not close it: docs/performance.md, CPU). Where it reads one
// head's slice of each row, the next block is prefetched first.
template <typename L, typename F, typename T = float>
inline void for_blocks(const int32_t* table, int64_t len, const L& l, F&& f,
                       const T* head = nullptr) {
  const bool whole = l.head_dim == l.token_stride;
  const int64_t block_bytes = l.block_size * l.token_stride * static_cast<int64_t>(sizeof(T));
  const int64_t run = std::max<int64_t>(1, kReadAheadBytes / block_bytes);
  const int64_t blocks = (len + l.block_size - 1) / l.block_size;
  for (int64_t start = 0, b = 0; start < len; start += l.block_size, ++b) {
    if (head != nullptr && whole && b % run == 0)
      read_ahead(head, table, b, std::min(blocks, b + run), block_bytes, l);
    if (head != nullptr && !whole && start + l.block_size < len)
      prefetch_rows(head + table[b + 1] * l.block_stride, l);
    f(start, table[b] * l.block_stride, std::min(l.block_size, len - start));
  }
}

}  // namespace paged
