// A CPU allocator for tessel's worker processes: large blocks are kept when freed and handed
// out again for a request of the same size, but the blocks held (in use and kept) never add up
// to more than the most that was ever in use at once, so a worker holds what its program holds.
//
// A training or inference step asks for the same sizes in the same order every time, so after
// the first step nearly every large request is served from a kept block instead of fresh pages
// the kernel must fault in and zero. Where a fresh block would push the total over that bound,
// the blocks kept longest are returned to the system first.
//
// Small blocks (below kLarge) go to the allocator that was installed before, as do all blocks
// when this library is not loaded. Built by tessel/runtime/cpu_cache.py against torch's c10.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kLarge = 128 * 1024;  // glibc's own mmap threshold
constexpr size_t kPage = 4096;

class BlockCache {
 public:
  void* take(size_t size) {
    std::lock_guard<std::mutex> hold(mutex_);
    auto found = kept_.find(size);
    if (found != kept_.end() && !found->second.empty()) {
      auto entry = found->second.back();
      found->second.pop_back();
      void* block = entry->second;
      age_.erase(entry);
      kept_bytes_ -= size;
      used_bytes_ += size;
      ++hits_;
      return block;
    }
    while (kept_bytes_ > 0 && used_bytes_ + kept_bytes_ + size > bound_) {
      drop_oldest();
    }
    void* block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED && !age_.empty()) {  // short of memory: return what is kept, retry
      while (!age_.empty()) {
        drop_oldest();
      }
      block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, block != MAP_FAILED, "tessel's CPU block cache: could not map ",
                     size, " bytes (", used_bytes_, " in use)");
    size_of_[block] = size;
    used_bytes_ += size;
    bound_ = std::max(bound_, used_bytes_);
    ++misses_;
    return block;
  }

  // Keeps `block` for the next request of its size; false if the cache did not map it.
  bool give(void* block) {
    std::lock_guard<std::mutex> hold(mutex_);
    auto found = size_of_.find(block);
    if (found == size_of_.end()) {
      return false;
    }
    size_t size = found->second;
    used_bytes_ -= size;
    kept_bytes_ += size;
    age_.emplace_back(size, block);
    kept_[size].push_back(std::prev(age_.end()));
    return true;
  }

  // Returns every kept block, and bounds what is held by what is in use now: a model unloaded,
  // the next one's peak is its own.
  void release() {
    std::lock_guard<std::mutex> hold(mutex_);
    while (!age_.empty()) {
      drop_oldest();
    }
    bound_ = used_bytes_;
  }

  void stats(size_t* out) {
    std::lock_guard<std::mutex> hold(mutex_);
    out[0] = used_bytes_;
    out[1] = kept_bytes_;
    out[2] = bound_;
    out[3] = hits_;
    out[4] = misses_;
    out[5] = dropped_;
  }

 private:
  using Age = std::list<std::pair<size_t, void*>>;

  void drop_oldest() {
    auto [size, block] = age_.front();
    auto& same = kept_[size];
    for (auto it = same.begin(); it != same.end(); ++it) {
      if ((*it)->second == block) {
        same.erase(it);
        break;
      }
    }
    age_.pop_front();
    size_of_.erase(block);
    munmap(block, size);
    kept_bytes_ -= size;
    ++dropped_;
  }

  std::mutex mutex_;
  Age age_;                                                // kept blocks, oldest first
  std::unordered_map<size_t, std::vector<Age::iterator>> kept_;  // kept blocks by size
  std::unordered_map<void*, size_t> size_of_;              // every block mapped, by address
  size_t used_bytes_ = 0, kept_bytes_ = 0, bound_ = 0;
  size_t hits_ = 0, misses_ = 0, dropped_ = 0;
};

BlockCache& cache() {
  static auto* instance = new BlockCache();  // never destroyed: blocks may be freed at exit
  return *instance;
}

c10::DeleterFnPtr small_delete = nullptr;  // the raw deleter of the allocator for small blocks

// Frees a block of either size: raw_deallocate hands any block this allocator made to it.
void give_back(void* block) {
  if (!cache().give(block)) {
    small_delete(block);
  }
}

class CachingCPUAllocator final : public c10::Allocator {
 public:
  explicit CachingCPUAllocator(c10::Allocator* small) : small_(small) {
    small_delete = small->raw_deleter();
  }

  c10::DataPtr allocate(size_t bytes) override {
    if (bytes < kLarge) {
      return small_->allocate(bytes);
    }
    void* block = cache().take((bytes + kPage - 1) / kPage * kPage);
    return {block, block, &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  // Kernels that allocate scratch space through the raw API need one deleter for every block.
  c10::DeleterFnPtr raw_deleter() const override {
    return small_delete != nullptr ? &give_back : nullptr;
  }

  void copy_data(void* dest, const void* src, size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  c10::Allocator* small_;
};

}  // namespace

// Makes the cache the process's CPU allocator (once; later calls change nothing).
extern "C" void tessel_install_cpu_cache() {
  static auto* allocator = [] {
    auto* made = new CachingCPUAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(made, /*priority=*/10);
    return made;
  }();
  (void)allocator;
}

// Returns every kept block to the system (a model was unloaded).
extern "C" void tessel_release_cpu_cache() { cache().release(); }

// Bytes in use, bytes kept, the bound, then counts of hits, fresh blocks and dropped blocks.
extern "C" void tessel_cpu_cache_stats(size_t* out) { cache().stats(out); }
