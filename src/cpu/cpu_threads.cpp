#include "cpu_threads.hpp"

#include "core/config.hpp"

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace flashport::cpu {

int hardware_threads() {
  static const int n = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      const int c = CPU_COUNT(&set);
      if (c > 0) return c;
    }
    const unsigned h = std::thread::hardware_concurrency();
    return h > 0 ? static_cast<int>(h) : 1;
  }();
  return n;
}

int resolve_threads(int32_t requested) {
  int n = requested;
  if (n <= 0) n = runtime_config().num_threads;
  if (n <= 0) n = hardware_threads();
  return n < hardware_threads() ? n : hardware_threads();
}

namespace {

struct Job {
  int64_t num_tasks = 0;
  const std::function<void(int64_t)>* fn = nullptr;
  std::atomic<int64_t> next{0};
  int slots = 0;     // helpers that may still join
  int joined = 0;    // helpers that joined (guarded by the pool mutex)
  int finished = 0;  // helpers that are done (guarded by the pool mutex)

  void work() {
    for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) (*fn)(t);
  }
};

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }

  void run(int64_t num_tasks, int threads, const std::function<void(int64_t)>& fn) {
    int want = threads - 1;
    if (want > num_tasks - 1) want = static_cast<int>(num_tasks - 1);
    const int helpers = want > 0 ? borrow(want) : 0;
    Job job;
    job.num_tasks = num_tasks;
    job.fn = &fn;
    if (helpers == 0) {
      job.work();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job.slots = helpers;
      jobs_.push_back(&job);
    }
    work_cv_.notify_all();
    job.work();
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Helpers that have not joined yet are not needed any more.
      for (auto it = jobs_.begin(); it != jobs_.end(); ++it)
        if (*it == &job) {
          jobs_.erase(it);
          break;
        }
      done_cv_.wait(lock, [&] { return job.finished == job.joined; });
    }
    free_helpers_.fetch_add(helpers);
  }

 private:
  Pool() {
    const int n = hardware_threads() - 1;
    free_helpers_.store(n);
    for (int i = 0; i < n; ++i) std::thread([this] { worker(); }).detach();
  }

  int borrow(int want) {
    int have = free_helpers_.load();
    while (have > 0) {
      const int take = want < have ? want : have;
      if (free_helpers_.compare_exchange_weak(have, have - take)) return take;
    }
    return 0;
  }

  void worker() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return !jobs_.empty(); });
      Job* job = jobs_.front();
      ++job->joined;
      if (--job->slots == 0) jobs_.pop_front();
      lock.unlock();
      job->work();
      lock.lock();
      ++job->finished;
      done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Job*> jobs_;
  std::atomic<int> free_helpers_{0};
};

}  // namespace

void parallel_for(int64_t num_tasks, int threads, const std::function<void(int64_t)>& fn) {
  if (num_tasks <= 0) return;
  if (threads <= 1 || num_tasks == 1) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  Pool::get().run(num_tasks, threads, fn);
}

}  // namespace flashport::cpu
