// A fixed pool of threads running queued tasks in FIFO order. Thread-safe.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace gkv {

class ThreadPool {
 public:
  explicit ThreadPool(int threads) : running_(threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Run(); });
  }
  // Runs every queued task (and what they queue meanwhile), then joins. The pool stays valid
  // while that happens (a task may still call Submit or queued()); once every worker has ended,
  // Submit runs its task on the caller's thread. Idempotent; call it before destroying the owner's
  // pointer (unique_ptr::reset nulls the pointer before the destructor runs the queued tasks).
  void Join() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) {
      if (t.joinable()) t.join();
    }
  }
  ~ThreadPool() { Join(); }
  // Tasks queued and not yet started.
  size_t queued() {
    std::lock_guard<std::mutex> lock(mu_);
    return tasks_.size();
  }
  void Submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!(stopping_ && running_ == 0)) {
        tasks_.push_back(std::move(task));
        cv_.notify_one();
        return;
      }
    }
    task();  // joined: no worker is left to run it
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) {
          --running_;
          return;
        }
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  int running_ = 0;                          // workers not yet ended; guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace gkv
