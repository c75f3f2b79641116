// A CPU allocator for tessel's worker processes: freed large blocks are kept and handed out
// again, but the memory held (in use and kept) never adds up to more than the most that was
// ever in use at once, so a worker holds what its program holds.
//
// A training or inference step asks for the same sizes in the same order every time, so after
// the first step its large requests are served from kept memory instead of fresh pages the
// kernel must fault in and zero. A step frees its blocks in another order of sizes than it
// asks for them, so the memory is kept as ranges of addresses, not as blocks of one size: a
// request takes the front of the smallest kept range that holds it, the rest stays kept, and a
// freed block joins the kept ranges beside it. A request no kept range holds, where enough is
// kept in pieces, gets a new block that the pieces' pages are moved into (mremap moves page
// tables, not bytes). (Kept by size alone, a quarter of a Llama prefill's requests were mapped
// afresh every step.) Where a fresh block would push the total over that bound, the ranges kept
// longest are returned to the system first, as much of them as makes room.
//
// Small blocks (below kLarge) go to the allocator that was installed before, as do all blocks
// when this library is not loaded. Built by tessel/runtime/cpu_cache.py against torch's c10.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

namespace {

constexpr size_t kLarge = 128 * 1024;  // glibc's own mmap threshold
constexpr size_t kPage = 4096;

class BlockCache {
 public:
  void* take(size_t size) {
    std::lock_guard<std::mutex> hold(mutex_);
    auto smallest = by_size_.lower_bound({size, nullptr});
    if (smallest != by_size_.end()) {
      auto [held, start] = *smallest;
      uint64_t stamp = kept_[start].stamp;
      unkeep(start);
      if (held > size) {  // the rest stays kept, as old as the range was
        keep(start + size, held - size, stamp);
      }
      ++hits_;
      return hand_out(start, size);
    }
    if (kept_bytes_ >= size) {  // enough kept, in pieces: moved together, a page map each
      if (char* block = map(size)) {
        return joined(block, size);
      }
    }
    make_room(size);
    char* block = map(size);
    if (block == nullptr && !kept_.empty()) {  // short of memory: return what is kept, retry
      while (!kept_.empty()) {
        drop_oldest();
      }
      block = map(size);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, block != nullptr, "tessel's CPU block cache: could not map ",
                     size, " bytes (", used_bytes_, " in use)");
    ++misses_;
    return hand_out(block, size);
  }

  // Keeps `block` with the kept ranges beside it; false if the cache did not hand it out.
  bool give(void* block) {
    std::lock_guard<std::mutex> hold(mutex_);
    auto found = in_use_.find(block);
    if (found == in_use_.end()) {
      return false;
    }
    char* start = static_cast<char*>(block);
    size_t size = found->second;
    in_use_.erase(found);
    used_bytes_ -= size;
    auto after = kept_.find(start + size);
    if (after != kept_.end()) {
      size += after->second.size;
      unkeep(after->first);
    }
    auto before = kept_.lower_bound(start);
    if (before != kept_.begin()) {
      --before;
      if (before->first + before->second.size == start) {
        start = before->first;
        size += before->second.size;
        unkeep(start);
      }
    }
    keep(start, size, ++clock_);
    return true;
  }

  // Returns every kept range, and bounds what is held by what is in use now: a model unloaded,
  // the next one's peak is its own.
  void release() {
    std::lock_guard<std::mutex> hold(mutex_);
    while (!kept_.empty()) {
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
    out[6] = joins_;
  }

 private:
  struct Range {
    size_t size;
    uint64_t stamp;  // when it was last freed: the oldest ranges are returned first
  };

  // The new block `start` (mapped, none of its pages touched) filled with kept pages, the
  // largest ranges first: mremap moves a range's pages to the block's addresses without
  // copying or faulting them. A range mremap cannot move (one that spans blocks the kernel
  // mapped apart) ends the filling, and the rest of the block is fresh pages.
  char* joined(char* start, size_t size) {
    size_t filled = 0;
    while (filled < size) {
      auto [held, from] = *by_size_.rbegin();
      size_t part = std::min(held, size - filled);
      char* tail = from + held - part;
      if (mremap(tail, part, part, MREMAP_MAYMOVE | MREMAP_FIXED, start + filled) == MAP_FAILED) {
        break;
      }
      uint64_t stamp = kept_[from].stamp;
      unkeep(from);
      if (part < held) {
        keep(from, held - part, stamp);
      }
      filled += part;
    }
    make_room(size);  // for the pages not moved, which are fresh
    ++(filled == size ? joins_ : misses_);
    return hand_out(start, size);
  }

  static char* map(size_t size) {
    void* block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return block == MAP_FAILED ? nullptr : static_cast<char*>(block);
  }

  // Returns the oldest kept memory until `size` more bytes stay within the bound.
  void make_room(size_t size) {
    while (kept_bytes_ > 0 && used_bytes_ + kept_bytes_ + size > bound_) {
      drop_oldest(used_bytes_ + kept_bytes_ + size - bound_);
    }
  }

  // Counts `start` in use (and the bound with it, for a block that adds to what is held).
  char* hand_out(char* start, size_t size) {
    in_use_[start] = size;
    used_bytes_ += size;
    bound_ = std::max(bound_, used_bytes_);
    return start;
  }

  void keep(char* start, size_t size, uint64_t stamp) {
    kept_[start] = {size, stamp};
    by_size_.insert({size, start});
    by_age_.insert({stamp, start});
    kept_bytes_ += size;
  }

  void unkeep(char* start) {
    auto found = kept_.find(start);
    by_size_.erase({found->second.size, start});
    by_age_.erase({found->second.stamp, start});
    kept_bytes_ -= found->second.size;
    kept_.erase(found);
  }

  // Returns the kept range freed longest ago to the system, or only its last `most` bytes.
  void drop_oldest(size_t most = SIZE_MAX) {
    char* start = by_age_.begin()->second;
    Range range = kept_[start];
    unkeep(start);
    size_t gone = std::min(most, range.size);
    // a range may span blocks mapped apart: munmap takes any run of pages
    munmap(start + range.size - gone, gone);
    if (gone < range.size) {
      keep(start, range.size - gone, range.stamp);
    }
    ++dropped_;
  }

  std::mutex mutex_;
  std::map<char*, Range> kept_;                   // kept ranges by address
  std::set<std::pair<size_t, char*>> by_size_;    // the same, by size
  std::set<std::pair<uint64_t, char*>> by_age_;   // the same, by when they were freed
  std::unordered_map<void*, size_t> in_use_;      // blocks handed out, by address
  uint64_t clock_ = 0;
  size_t used_bytes_ = 0, kept_bytes_ = 0, bound_ = 0;
  size_t hits_ = 0, misses_ = 0, dropped_ = 0, joins_ = 0;
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

// Bytes in use, bytes kept, the bound, then counts of hits, fresh blocks, dropped ranges and
// blocks joined from kept ranges.
extern "C" void tessel_cpu_cache_stats(size_t* out) { cache().stats(out); }
