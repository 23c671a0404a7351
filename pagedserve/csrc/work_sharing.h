// A parallel loop over independent items whose threads share out the last items at run
// time: each thread takes its equal share in order, then, once it has none left, items from
// the back of another thread's share ("work stealing", as in Blumofe & Leiserson,
// "Scheduling Multithreaded Computations by Work Stealing", 1999, with ranges of items in
// place of deques). On shared hosts one core often runs slower than the other for a while;
// with fixed shares the faster thread then waits at the end of every loop: on a 2-core Zen 5
// VM, in default-path runs, each thread waited for the other inside the GGUF products 3.8%
// and 5.0% of its time (perf, both threads sampled). With the items shared out, the Q4_1
// products of a decode step's 30 layers ran 1.04-1.14x faster at 8-64 rows (level at 1-2)
// and decode steps 1.02-1.04x (benchmarks/README.md). An item's result does not depend on
// which thread computes it, so the bits are those of fixed shares.
// (cpu_ops.py keys the build on this header too.)

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

namespace pagedserve_sharing {

// A thread's items left, [begin, end), in one word: its owner takes from the front and
// another thread from the back, each by compare-and-swap, with no lock. On its own cache
// line, so that an owner taking its items touches no other core's line.
struct alignas(64) Share {
  std::atomic<uint64_t> range{0};

  static uint64_t pack(uint64_t begin, uint64_t end) { return end << 32 | begin; }

  // The items left from the first up to the next multiple of `run` (taken): [begin, end),
  // or begin = -1 if none is.
  std::pair<int64_t, int64_t> take_front(uint64_t run) {
    uint64_t v = range.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t begin = v & 0xffffffffu, end = v >> 32;
      if (begin >= end) return {-1, -1};
      const uint64_t stop = std::min(end, (begin / run + 1) * run);
      if (range.compare_exchange_weak(v, pack(stop, end), std::memory_order_relaxed))
        return {static_cast<int64_t>(begin), static_cast<int64_t>(stop)};
    }
  }

  // The last item left (taken), or -1 if none is.
  int64_t take_back() {
    uint64_t v = range.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t begin = v & 0xffffffffu, end = v >> 32;
      if (begin >= end) return -1;
      if (range.compare_exchange_weak(v, pack(begin, end - 1), std::memory_order_relaxed))
        return static_cast<int64_t>(end - 1);
    }
  }

  // Whether item i is still left (a hint: another thread may take it at once).
  bool holds(int64_t i) const {
    const uint64_t v = range.load(std::memory_order_relaxed);
    return i >= 0 && static_cast<uint64_t>(i) >= (v & 0xffffffffu) &&
           static_cast<uint64_t>(i) < (v >> 32);
  }
};

// fn(begin, end, next) for runs of items [begin, end) that cover [0, n) (n < 2^32) once, on
// at::get_num_threads() threads at most. A thread takes its own share's items in order, up
// to each multiple of `run` at a time (items that belong together, e.g. a weight panel's
// groups of rows), then other shares' items one at a time from the back. next: the item
// this thread will likely take after `end - 1`, for a prefetch (another thread may take it
// meanwhile), or -1.
template <typename F>
void for_each_run(int64_t n, int64_t run, const F& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; i += run) fn(i, std::min(n, i + run), i + run < n ? i + run : -1);
    return;
  }
  std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t t = 0; t < threads; ++t)
    shares[t].range.store(Share::pack(n * t / threads, n * (t + 1) / threads),
                          std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Share& own = shares[t];
      for (;;) {
        const auto [i, stop] = own.take_front(run);
        if (i < 0) break;
        fn(i, stop, own.holds(stop) ? stop : -1);
      }
      for (int64_t o = 1; o < threads; ++o) {
        Share& other = shares[(t + o) % threads];
        for (int64_t i; (i = other.take_back()) >= 0;)
          fn(i, i + 1, other.holds(i - 1) ? i - 1 : -1);
      }
    }
  });
}

// fn(i, next) for every item i in [0, n), as for_each_run with runs of one item.
template <typename F>
void for_each_item(int64_t n, const F& fn) {
  for_each_run(n, 1, [&](int64_t i, int64_t, int64_t next) { fn(i, next); });
}

}  // namespace pagedserve_sharing
