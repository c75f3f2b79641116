// The meeting point of a group's CPU workers on one machine (`shared_memory.py`): each rank
// says it has reached a round, then waits until every rank has.
//
// A group's segment starts with one 64-byte line of its own and one per rank:
//   line 0:      uint32 sleepers  (ranks asleep in futex_wait on some rank's round)
//   line r + 1:  uint32 round     (the last round rank r reached; rounds count from 1 and wrap)
//                int32 pid        (rank r's process, to tell a slow rank from a dead one)
// A rank publishes its round with a release store after writing its data, and a reader's
// acquire load of every round makes their data visible before it reads it. A waiter polls
// `spins` times (its peers are usually a few microseconds away), then yields for `yield_s`
// seconds, then sleeps on the futex of the rank it waits for, which that rank wakes when it
// arrives; the caller gives no polls where the peer may be waiting for its core.

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int kLine = 64;
constexpr long kSleepNs = 10000000;  // the longest sleep between checks of the clock

uint32_t* sleepers(char* segment) { return reinterpret_cast<uint32_t*>(segment); }

uint32_t* round_of(char* segment, int rank) {
  return reinterpret_cast<uint32_t*>(segment + kLine * (rank + 1));
}

int32_t* pid_of(char* segment, int rank) {
  return reinterpret_cast<int32_t*>(segment + kLine * (rank + 1) + 4);
}

// rounds wrap at 2^32: `seen` has reached `round` when it is not behind it
bool reached(uint32_t seen, uint32_t round) { return static_cast<int32_t>(seen - round) >= 0; }

double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

void pause_briefly() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// a process that has exited, reaped or not (a zombie still answers kill(pid, 0))
bool gone(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* stat = fopen(path, "r");
  if (stat == nullptr) return false;
  char line[512];
  const size_t read = fread(line, 1, sizeof line - 1, stat);
  fclose(stat);
  line[read] = '\0';
  const char* end = strrchr(line, ')');  // the state follows the command's closing parenthesis
  return end != nullptr && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}

long futex(uint32_t* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, word, op, value, timeout, nullptr, 0);
}

}  // namespace

extern "C" {

// Record this process as `rank` of the segment.
void tessel_shm_join(char* segment, int rank) {
  __atomic_store_n(pid_of(segment, rank), static_cast<int32_t>(getpid()), __ATOMIC_SEQ_CST);
}

// Reach `round` as `rank` of `ranks` and wait until every rank has (polling, yielding, then
// sleeping, as above). Returns -1 once they all have; r when rank r has not within
// `timeout_s`; -2 - r when rank r's process is gone.
int tessel_shm_meet(char* segment, int ranks, int rank, uint32_t round, double timeout_s, int spins,
                    double yield_s) {
  __atomic_store_n(round_of(segment, rank), round, __ATOMIC_SEQ_CST);
  // a waiter counts itself in before its last look at the round (both sequentially
  // consistent), so either it sees this round or this rank sees it counted and wakes it
  if (__atomic_load_n(sleepers(segment), __ATOMIC_SEQ_CST) != 0) {
    futex(round_of(segment, rank), FUTEX_WAKE, INT_MAX, nullptr);
  }
  const double start = now();
  double checked = start;
  for (int r = 0; r < ranks; ++r) {
    uint32_t* word = round_of(segment, r);
    for (long spin = 0;; ++spin) {
      uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
      if (reached(seen, round)) break;
      if (spin < spins) {
        pause_briefly();
        continue;
      }
      const double t = now();
      if (t - start < yield_s) {
        sched_yield();
        continue;
      }
      __atomic_fetch_add(sleepers(segment), 1, __ATOMIC_SEQ_CST);
      seen = __atomic_load_n(word, __ATOMIC_SEQ_CST);
      if (!reached(seen, round)) {
        const timespec nap{0, kSleepNs};
        futex(word, FUTEX_WAIT, seen, &nap);
      }
      __atomic_fetch_sub(sleepers(segment), 1, __ATOMIC_SEQ_CST);
      if (reached(__atomic_load_n(word, __ATOMIC_ACQUIRE), round)) break;
      const double later = now();
      if (later - start > timeout_s) return r;
      if (later - checked > 0.1) {
        checked = later;
        if (gone(__atomic_load_n(pid_of(segment, r), __ATOMIC_SEQ_CST))) return -2 - r;
      }
    }
  }
  return -1;
}

}  // extern "C"
