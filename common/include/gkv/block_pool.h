// Recycled small heap blocks for what a request makes and drops once (closures that a
// std::function keeps on the heap, shared_ptr control blocks, map nodes), so that
// a hot path calls malloc only while the pool warms up.
//
//   BlockPool::Allocate / Free      raw blocks, by size class
//   PoolAllocator<T>                an allocator on them (allocate_shared, containers)
//   Pooled(f)                       a callable whose heap copy (inside a std::function) is one
//
// Blocks are kept per thread, in size classes of 32 bytes up to 512 bytes, at most kKeep per
// class; a block freed on another thread than the one that took it joins the freeing thread's
// list, and lists pass surplus blocks to each other in batches through one shared list per class
// (a mutex taken once per kBatch blocks), so a thread that makes requests whose closures another
// thread drops still finds blocks. Larger requests, over-aligned types and everything under
// AddressSanitizer (which must see each object's lifetime) go straight to operator new.
// Thread-safe. A thread's own blocks are freed when it exits.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <new>
#include <type_traits>
#include <utility>

#include "gkv/sanitizers.h"

namespace gkv {

class BlockPool {
 public:
  static constexpr size_t kGranule = 32;
  static constexpr size_t kMaxBlock = 512;
  static constexpr size_t kKeep = kAddressSanitizer ? 0 : 256;  // per thread and class
  static constexpr size_t kBatch = 64;         // moved to or from the shared lists at once
  static constexpr size_t kSharedKeep = 1024;  // per class in the shared lists

  static void* Allocate(size_t size) {
    if (size > kMaxBlock || kKeep == 0 || ThreadGone()) return ::operator new(size);
    const size_t c = ClassOf(size);
    Lists& l = Mine();
    if (l.head[c] == nullptr) Refill(l, c);
    if (Block* b = l.head[c]) {
      l.head[c] = b->next;
      l.count[c]--;
      return b;
    }
    return ::operator new((c + 1) * kGranule);
  }

  static void Free(void* p, size_t size) noexcept {
    if (p == nullptr) return;
    if (size > kMaxBlock || kKeep == 0 || ThreadGone()) return ::operator delete(p);
    const size_t c = ClassOf(size);
    Lists& l = Mine();
    auto* b = static_cast<Block*>(p);
    b->next = l.head[c];
    l.head[c] = b;
    if (++l.count[c] > kKeep) Spill(l, c);
  }

 private:
  struct Block {
    Block* next;
  };
  static constexpr size_t kClasses = kMaxBlock / kGranule;
  struct Lists {
    Block* head[kClasses] = {};
    size_t count[kClasses] = {};
    ~Lists() {
      ThreadGone() = true;  // blocks freed after this (other thread_locals) go to delete
      for (Block*& h : head) {
        while (h) {
          Block* next = h->next;
          ::operator delete(h);
          h = next;
        }
      }
    }
  };
  // Where a thread that frees more than it takes (a request's closures made on a caller's
  // thread and dropped on the I/O thread) hands blocks to one that takes more than it frees.
  struct Shared {
    std::mutex mu;
    Block* head[kClasses] = {};
    // Written under mu; read without it to skip the lock when a class has nothing to give.
    std::atomic<size_t> count[kClasses] = {};
  };
  static size_t ClassOf(size_t size) { return size == 0 ? 0 : (size - 1) / kGranule; }
  static Lists& Mine() {
    static thread_local Lists lists;
    return lists;
  }
  // Set once this thread's lists are destroyed (at its exit): trivially destructible, so it
  // stays readable while the thread's other thread_locals are destroyed after them.
  static bool& ThreadGone() {
    static thread_local bool gone = false;
    return gone;
  }
  static Shared& Common() {
    static Shared* shared = new Shared;  // never destroyed: threads may exit after statics go
    return *shared;
  }
  // Moves up to kBatch blocks of class c from the shared lists to this thread's.
  static void Refill(Lists& l, size_t c) {
    Shared& g = Common();
    if (g.count[c].load(std::memory_order_relaxed) == 0) return;
    std::lock_guard<std::mutex> lock(g.mu);
    for (size_t i = 0; i < kBatch && g.head[c]; ++i) {
      Block* b = g.head[c];
      g.head[c] = b->next;
      g.count[c]--;
      b->next = l.head[c];
      l.head[c] = b;
      l.count[c]++;
    }
  }
  // Moves kBatch blocks of class c from this thread's list to the shared lists (freeing what
  // does not fit there).
  static void Spill(Lists& l, size_t c) noexcept {
    Shared& g = Common();
    std::lock_guard<std::mutex> lock(g.mu);
    for (size_t i = 0; i < kBatch && l.head[c]; ++i) {
      Block* b = l.head[c];
      l.head[c] = b->next;
      l.count[c]--;
      if (g.count[c] >= kSharedKeep) {
        ::operator delete(b);
        continue;
      }
      b->next = g.head[c];
      g.head[c] = b;
      g.count[c]++;
    }
  }
};

// Stateless: any two compare equal, and memory taken through one may be given back through
// another (of any thread).
template <class T>
struct PoolAllocator {
  using value_type = T;
  PoolAllocator() noexcept = default;
  template <class U>
  PoolAllocator(const PoolAllocator<U>&) noexcept {}  // NOLINT: converting, as allocators are

  T* allocate(size_t n) {
    if constexpr (alignof(T) > __STDCPP_DEFAULT_NEW_ALIGNMENT__) {
      return std::allocator<T>().allocate(n);
    } else {
      return static_cast<T*>(BlockPool::Allocate(n * sizeof(T)));
    }
  }
  void deallocate(T* p, size_t n) noexcept {
    if constexpr (alignof(T) > __STDCPP_DEFAULT_NEW_ALIGNMENT__) {
      std::allocator<T>().deallocate(p, n);
    } else {
      BlockPool::Free(p, n * sizeof(T));
    }
  }
  template <class U>
  bool operator==(const PoolAllocator<U>&) const noexcept {
    return true;
  }
};

// A callable that a std::function stores on the heap (too large for its small buffer, or not
// trivially copyable, as any closure holding a shared_ptr) takes its block from the pool: the
// std::function's `new` of it finds this class's operator new.
template <class F>
struct PooledCallable : F {
  // Blocks are aligned as operator new's are, no more.
  static_assert(alignof(F) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__, "an over-aligned capture");
  explicit PooledCallable(F f) : F(std::move(f)) {}
  static void* operator new(size_t size) { return BlockPool::Allocate(size); }
  static void operator delete(void* p, size_t size) noexcept { BlockPool::Free(p, size); }
};

template <class F>
PooledCallable<std::decay_t<F>> Pooled(F&& f) {
  return PooledCallable<std::decay_t<F>>(std::forward<F>(f));
}

// make_shared from the pool (object and control block in one pooled block).
template <class T, class... Args>
std::shared_ptr<T> MakePooledShared(Args&&... args) {
  return std::allocate_shared<T>(PoolAllocator<T>(), std::forward<Args>(args)...);
}

}  // namespace gkv
