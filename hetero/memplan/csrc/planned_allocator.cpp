// The planned allocator: a memory plan served for real.
//
// One arena is reserved up front; the step's allocation requests are matched to the plan in the
// order they were recorded (a request takes the next plan entry of its size and phase, looking a
// few entries ahead to resynchronise after an unplanned request), and a matched request is placed
// at its planned offset unless that range is still held by a live block (a safety check, so a run
// that strays from the plan can never hand out memory twice). Anything unmatched is served by a
// small caching pool (best fit among freed blocks at most twice the request, else a new block).
// Step boundaries move the cursor back to the start of the plan; phase marks move it to the first
// entry of that phase.
//
// Modes: PASS (installed, nothing recorded: raw blocks), RECORD (raw blocks, every request and free
// of the owning thread logged for the planner), SERVE (arena + fallback pool, counters).
// Raw blocks come from the backend (posix_memalign on the CPU, cudaMalloc on CUDA) and are freed
// whenever their tensor dies, whatever the mode then.
//
// On the CPU the core is installed with c10::SetCPUAllocator; a tensor made before the install
// keeps the deleter of the allocator that made it (c10's DataPtr carries its deleter), and a raw
// pointer this allocator does not know is handed to the previous allocator's raw deleter. With
// HETERO_WITH_CUDA the same core is exported as the two C functions that
// torch.cuda.memory.CUDAPluggableAllocator loads (hetero_planned_malloc / hetero_planned_free).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#ifdef HETERO_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;

namespace {

constexpr size_t kAlign = 512;          // plan offsets and fallback blocks: multiples of this
constexpr size_t kWindow = 64;          // plan entries looked at past the cursor to resynchronise
enum Mode { PASS = 0, RECORD = 1, SERVE = 2 };
enum Kind { RAW = 0, ARENA = 1, FALLBACK = 2 };

size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Entry {
  int64_t size;
  int64_t offset;   // -1: in the plan's order but not placed (served by the fallback pool)
  int32_t phase;
  int64_t stream;
};

struct Live {
  size_t size;      // the bytes requested
  size_t held;      // the bytes the block occupies (rounded)
  Kind kind;
  int64_t id;       // its id in the record log, or -1
};

struct LogEvent {
  int32_t step;
  int8_t alloc;     // 1 alloc, 0 free
  int64_t id;
  int64_t size;
  int32_t phase;
  int64_t stream;
};

struct Backend {
  void* (*alloc)(size_t) = nullptr;
  void (*free)(void*) = nullptr;
};

void* cpu_raw_alloc(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, std::max<size_t>(n, 1)) != 0) return nullptr;
  return p;
}
void cpu_raw_free(void* p) { std::free(p); }

class Core {
 public:
  std::mutex mu;
  Backend backend;
  Mode mode = PASS;
  std::thread::id owner;
  int32_t step = 0, phase = 0;

  // the plan
  std::vector<Entry> plan;
  std::vector<size_t> phase_start;   // first plan entry of each phase
  char* arena = nullptr;
  size_t arena_bytes = 0;
  size_t cursor = 0;
  std::map<size_t, size_t> arena_busy;   // offset -> end of every live arena block

  // the fallback pool
  std::multimap<size_t, void*> pool_free;          // held size -> block
  std::unordered_map<void*, size_t> pool_held;     // every pool block -> held size

  std::unordered_map<void*, Live> live;
  std::vector<LogEvent> log;
  int64_t next_id = 0;

  // counters (from the start of serving)
  size_t live_bytes = 0, peak_live = 0, fallback_reserved = 0, fallback_peak = 0;
  int64_t planned_hits = 0, fallback_allocs = 0, unplanned_matches = 0, overlaps = 0, mismatches = 0;
  size_t planned_served_bytes = 0, fallback_served_bytes = 0;
  std::vector<int64_t> refused;   // the first plan entries refused for a held range (diagnosis)

  void* malloc(size_t n, int64_t stream) {
    if (n == 0) return nullptr;
    std::lock_guard<std::mutex> g(mu);
    bool mine = std::this_thread::get_id() == owner;
    if (mode == SERVE) {
      if (mine) {
        int64_t off = match(static_cast<int64_t>(n), stream);
        if (off >= 0) {
          size_t held = round_up(n);
          if (free_range(off, held)) {
            arena_busy[off] = off + held;
            void* p = arena + off;
            live[p] = Live{n, held, ARENA, -1};
            ++planned_hits;
            planned_served_bytes += n;
            grow(n);
            return p;
          }
          ++overlaps;
          if (refused.size() < 64) refused.push_back(static_cast<int64_t>(cursor) - 1);
        } else if (off == -1) {
          ++unplanned_matches;
        } else {
          ++mismatches;
        }
      }
      return pool_alloc(n);
    }
    void* p = backend.alloc(n);
    if (!p) return nullptr;
    int64_t id = -1;
    if (mode == RECORD && mine) {
      id = next_id++;
      log.push_back(LogEvent{step, 1, id, static_cast<int64_t>(n), phase, stream});
    }
    live[p] = Live{n, n, RAW, id};
    return p;
  }

  // false: not a block of this allocator
  bool free(void* p) {
    if (p == nullptr) return true;
    std::lock_guard<std::mutex> g(mu);
    auto it = live.find(p);
    if (it == live.end()) return false;
    Live b = it->second;
    live.erase(it);
    if (b.id >= 0 && mode == RECORD) log.push_back(LogEvent{step, 0, b.id, static_cast<int64_t>(b.size), phase, 0});
    switch (b.kind) {
      case RAW:
        backend.free(p);
        break;
      case ARENA:
        arena_busy.erase(static_cast<size_t>(static_cast<char*>(p) - arena));
        shrink(b.size);
        break;
      case FALLBACK:
        pool_free.emplace(b.held, p);
        shrink(b.size);
        break;
    }
    return true;
  }

  void begin_step(int32_t s) {
    std::lock_guard<std::mutex> g(mu);
    step = s;
    phase = 0;
    cursor = 0;
  }

  void set_phase(int32_t ph) {
    std::lock_guard<std::mutex> g(mu);
    phase = ph;
    if (ph >= 0 && static_cast<size_t>(ph) < phase_start.size()) cursor = std::max(cursor, phase_start[ph]);
  }

  // install a plan and start serving; false when the arena cannot be reserved
  bool serve(const std::vector<int64_t>& sizes, const std::vector<int64_t>& offsets,
             const std::vector<int32_t>& phases, const std::vector<int64_t>& streams, size_t bytes) {
    std::lock_guard<std::mutex> g(mu);
    if (!arena_busy.empty()) return false;   // a previous arena is still in use
    if (arena) backend.free(arena);
    arena = bytes ? static_cast<char*>(backend.alloc(bytes)) : nullptr;
    if (bytes && !arena) return false;
    arena_bytes = bytes;
    plan.clear();
    phase_start.clear();
    for (size_t i = 0; i < sizes.size(); ++i) {
      plan.push_back(Entry{sizes[i], offsets[i], phases[i], streams.empty() ? 0 : streams[i]});
      while (phase_start.size() <= static_cast<size_t>(std::max(phases[i], 0))) phase_start.push_back(i);
    }
    cursor = 0;
    mode = SERVE;
    release_pool();
    live_bytes = peak_live = 0;
    fallback_peak = fallback_reserved;
    planned_hits = fallback_allocs = unplanned_matches = overlaps = mismatches = 0;
    planned_served_bytes = fallback_served_bytes = 0;
    refused.clear();
    return true;
  }

  py::dict stats() {
    std::lock_guard<std::mutex> g(mu);
    py::dict d;
    d["mode"] = static_cast<int>(mode);
    d["reserved_bytes"] = arena_bytes + fallback_peak;
    d["peak_live_bytes"] = peak_live;
    d["planned_bytes"] = arena_bytes;
    d["fallback_bytes"] = fallback_peak;
    d["planned_hits"] = planned_hits;
    d["fallback_allocs"] = fallback_allocs;
    d["planned_served_bytes"] = planned_served_bytes;
    d["fallback_served_bytes"] = fallback_served_bytes;
    d["unplanned_entries"] = unplanned_matches;
    d["overlap_refusals"] = overlaps;
    d["unmatched_requests"] = mismatches;
    d["plan_entries"] = plan.size();
    d["refused_entries"] = refused;
    return d;
  }

 private:
  // the offset of the plan entry this request takes; -1 an entry without an offset, -2 none matches
  int64_t match(int64_t n, int64_t stream) {
    size_t end = std::min(plan.size(), cursor + kWindow);
    for (size_t k = cursor; k < end; ++k) {
      const Entry& e = plan[k];
      if (e.phase != phase) break;
      if (e.size == n && e.stream == stream) {
        cursor = k + 1;
        return e.offset;
      }
    }
    return -2;
  }

  bool free_range(size_t off, size_t len) const {
    if (off + len > arena_bytes) return false;
    auto it = arena_busy.upper_bound(off);
    if (it != arena_busy.end() && it->first < off + len) return false;
    if (it != arena_busy.begin() && std::prev(it)->second > off) return false;
    return true;
  }

  void* pool_alloc(size_t n) {
    size_t held = round_up(n);
    void* p = nullptr;
    auto it = pool_free.lower_bound(held);
    if (it != pool_free.end() && it->first <= 2 * held) {
      held = it->first;
      p = it->second;
      pool_free.erase(it);
    } else {
      p = backend.alloc(held);
      if (!p) {   // give back what is cached and try once more
        release_pool();
        p = backend.alloc(held);
        if (!p) return nullptr;
      }
      pool_held[p] = held;
      fallback_reserved += held;
      fallback_peak = std::max(fallback_peak, fallback_reserved);
    }
    live[p] = Live{n, held, FALLBACK, -1};
    ++fallback_allocs;
    fallback_served_bytes += n;
    grow(n);
    return p;
  }

  void release_pool() {
    for (auto& kv : pool_free) {
      fallback_reserved -= pool_held[kv.second];
      pool_held.erase(kv.second);
      backend.free(kv.second);
    }
    pool_free.clear();
  }

  void grow(size_t n) {
    live_bytes += n;
    peak_live = std::max(peak_live, live_bytes);
  }
  void shrink(size_t n) { live_bytes -= std::min(live_bytes, n); }
};

Core& core() {
  static Core* c = new Core();   // never destroyed: tensors may outlive the interpreter's teardown
  return *c;
}

// ------------------------------------------------------------------ the CPU allocator

c10::Allocator* g_previous = nullptr;
c10::DeleterFnPtr g_previous_raw = nullptr;

void cpu_delete(void* p) {
  if (!core().free(p) && g_previous_raw != nullptr) g_previous_raw(p);
}

struct PlannedCPUAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = core().malloc(n, 0);
    if (n && !p) throw std::bad_alloc();
    return {p, p, &cpu_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &cpu_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

PlannedCPUAllocator g_cpu;

bool install_cpu() {
  Core& c = core();
  {
    std::lock_guard<std::mutex> g(c.mu);
    c.backend = Backend{&cpu_raw_alloc, &cpu_raw_free};
    c.owner = std::this_thread::get_id();
  }
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == &g_cpu) return true;
  g_previous = current;
  g_previous_raw = current->raw_deleter();
  c10::SetCPUAllocator(&g_cpu, /*priority=*/0);
  if (c10::GetCPUAllocator() != &g_cpu) {   // an allocator registered at a higher priority stays
    g_previous = nullptr;
    return false;
  }
  return true;
}

// back to the previous allocator; blocks already handed out are freed here when their tensors die
bool uninstall_cpu() {
  if (g_previous == nullptr || c10::GetCPUAllocator() != &g_cpu) return false;
  c10::SetCPUAllocator(g_previous, 0);
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  c.mode = PASS;
  return c10::GetCPUAllocator() == g_previous;
}

py::list take_log() {
  Core& c = core();
  std::vector<LogEvent> out;
  {
    std::lock_guard<std::mutex> g(c.mu);
    out.swap(c.log);
  }
  py::list l;
  for (const auto& e : out) l.append(py::make_tuple(e.step, e.alloc ? "alloc" : "free", e.id, e.size, e.phase, e.stream));
  return l;
}

void set_mode(int m) {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  c.mode = static_cast<Mode>(m);
  c.owner = std::this_thread::get_id();
}

}  // namespace

// ------------------------------------------------------------------ the CUDA entry points
#ifdef HETERO_WITH_CUDA
namespace {
void* cuda_raw_alloc(size_t n) {
  void* p = nullptr;
  return cudaMalloc(&p, n) == cudaSuccess ? p : nullptr;
}
void cuda_raw_free(void* p) { cudaFree(p); }
}  // namespace

extern "C" {
void* hetero_planned_malloc(ssize_t size, int device, cudaStream_t stream) {
  (void)device;
  return core().malloc(static_cast<size_t>(size), reinterpret_cast<int64_t>(stream));
}
void hetero_planned_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
  (void)size;
  (void)device;
  (void)stream;
  if (!core().free(ptr)) cudaFree(ptr);
}
}

static void use_cuda_backend() {
  Core& c = core();
  std::lock_guard<std::mutex> g(c.mu);
  c.backend = Backend{&cuda_raw_alloc, &cuda_raw_free};
  c.owner = std::this_thread::get_id();
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hetero's planned allocator (see hetero/memplan/serve.py)";
  m.def("install_cpu", &install_cpu, "make this the CPU allocator; False when c10 keeps another");
  m.def("uninstall_cpu", &uninstall_cpu, "restore the CPU allocator that was installed before");
  m.def("set_mode", &set_mode, "0 pass, 1 record, 2 serve (use serve()); the calling thread is the one matched");
  m.def("begin_step", [](int32_t s) { core().begin_step(s); });
  m.def("set_phase", [](int32_t p) { core().set_phase(p); });
  m.def("serve", [](const std::vector<int64_t>& sizes, const std::vector<int64_t>& offsets,
                    const std::vector<int32_t>& phases, const std::vector<int64_t>& streams, size_t bytes) {
    return core().serve(sizes, offsets, phases, streams, bytes);
  });
  m.def("take_log", &take_log, "the record log so far: (step, 'alloc'|'free', id, size, phase, stream)");
  m.def("stats", []() { return core().stats(); });
  m.def("live_blocks", []() {
    Core& c = core();
    std::lock_guard<std::mutex> g(c.mu);
    return c.live.size();
  });
#ifdef HETERO_WITH_CUDA
  m.def("use_cuda_backend", &use_cuda_backend);
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
