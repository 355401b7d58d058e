// FreeList<T>: objects of one type recycled by their owner instead of freed, so a path that
// makes and drops one per request allocates nothing in steady state.
//
// Take() hands out a kept object (in whatever state Give left it) or a new T; Give() keeps the
// object, up to `capacity` of them, and deletes the rest. The owner resets what an object holds
// before giving it back. Under AddressSanitizer nothing is kept, so a use after Give is still
// reported. Thread-safety: none; one thread (or one lock's holder) uses a list. The destructor
// deletes what is kept.
#pragma once

#include <cstddef>
#include <vector>

#include "gkv/sanitizers.h"

namespace gkv {

template <class T>
class FreeList {
 public:
  explicit FreeList(size_t capacity) : capacity_(kAddressSanitizer ? 0 : capacity) {}
  ~FreeList() {
    for (T* t : kept_) delete t;
  }
  FreeList(const FreeList&) = delete;
  FreeList& operator=(const FreeList&) = delete;

  T* Take() {
    if (kept_.empty()) return new T();
    T* t = kept_.back();
    kept_.pop_back();
    return t;
  }
  void Give(T* t) {
    if (kept_.size() < capacity_) {
      kept_.push_back(t);
    } else {
      delete t;
    }
  }

 private:
  size_t capacity_;
  std::vector<T*> kept_;
};

}  // namespace gkv
