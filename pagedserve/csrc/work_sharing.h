// A parallel loop over independent items whose threads share out the last items at run
// time: each thread takes its share in order (equal shares, or given ones: Shares), then,
// once it has none left, items from the back of another thread's share ("work stealing", as
// in Blumofe & Leiserson, "Scheduling Multithreaded Computations by Work Stealing", 1999,
// with ranges of items in place of deques). On shared hosts one core often runs slower than
// the other for a while; with fixed shares the faster thread then waits at the end of every
// loop: on a 2-core Zen 5 VM, in default-path runs, each thread waited for the other inside
// the GGUF products 3.8% and 5.0% of its time (perf, both threads sampled). With the items
// shared out, the Q4_1 products of a decode step's 30 layers ran 1.04-1.14x faster at 8-64
// rows (level at 1-2) and decode steps 1.02-1.04x; decode attention, whose threads start
// with runs of equal key counts, then gave decode steps another 0-1.7% (median 0.65%,
// benchmarks/README.md). An item's result does not depend on which thread computes it, so
// the bits are those of fixed shares.
// (cpu_ops.py keys the build on this header too.)

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

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

// The threads that share out n items: 1 inside a parallel region (whose loops run on the
// calling thread alone) or for one item, else at::get_num_threads() at most.
inline int64_t sharing_threads(int64_t n) {
  return at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), n);
}

// Items [0, first.back()) in shares, one a thread: thread t's share is [first[t], first[t +
// 1]) (first ascending, first[0] = 0). take(t, ...) gives thread t its share's items in
// order, then other shares' items one at a time from the back, until none is left.
class Shares {
 public:
  explicit Shares(const std::vector<int64_t>& first)
      : threads_(static_cast<int64_t>(first.size()) - 1), shares_(new Share[threads_]) {
    for (int64_t t = 0; t < threads_; ++t)
      shares_[t].range.store(Share::pack(first[t], first[t + 1]), std::memory_order_relaxed);
  }

  // fn(begin, end, next) for runs of items [begin, end) that thread t takes: of its own
  // share up to each multiple of `run` at a time (items that belong together, e.g. a weight
  // panel's groups of rows), then other shares' single items. next: the item thread t will
  // likely take after `end - 1`, for a prefetch (another thread may take it meanwhile), or -1.
  template <typename F>
  void take(int64_t t, int64_t run, const F& fn) const {
    Share& own = shares_[t];
    for (;;) {
      const auto [i, stop] = own.take_front(run);
      if (i < 0) break;
      fn(i, stop, own.holds(stop) ? stop : -1);
    }
    for (int64_t o = 1; o < threads_; ++o) {
      Share& other = shares_[(t + o) % threads_];
      for (int64_t i; (i = other.take_back()) >= 0;)
        fn(i, i + 1, other.holds(i - 1) ? i - 1 : -1);
    }
  }

 private:
  int64_t threads_;
  std::unique_ptr<Share[]> shares_;
};

// fn(begin, end, next) for runs of items [begin, end) that cover [0, n) (n < 2^32) once, on
// sharing_threads(n) threads, each starting with an equal share (Shares::take).
template <typename F>
void for_each_run(int64_t n, int64_t run, const F& fn) {
  const int64_t threads = sharing_threads(n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; i += run) fn(i, std::min(n, i + run), i + run < n ? i + run : -1);
    return;
  }
  std::vector<int64_t> first(threads + 1);
  for (int64_t t = 0; t <= threads; ++t) first[t] = n * t / threads;
  const Shares shares(first);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) shares.take(t, run, fn);
  });
}

// fn(i, next) for every item i in [0, n), as for_each_run with runs of one item.
template <typename F>
void for_each_item(int64_t n, const F& fn) {
  for_each_run(n, 1, [&](int64_t i, int64_t, int64_t next) { fn(i, next); });
}

}  // namespace pagedserve_sharing
