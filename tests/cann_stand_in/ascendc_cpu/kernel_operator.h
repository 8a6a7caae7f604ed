// TEST STAND-IN, NOT ASCEND C: a CPU implementation of the subset of Ascend C's device API
// (`kernel_operator.h`) that dist-tensor's kernels (src/device/ascend/kernels/) use, so that the
// executing CANN stand-in (tests/cann_stand_in/, built with -DSTANDIN_EXECUTE) can compile a
// kernel source with the host C++ compiler and run it on CPU threads, the way CANN's CPU
// debugging mode runs Ascend C on a host. Used only by tests/ascend_*.rs.
//
// What it models, and why each piece is there (a kernel that is wrong must fail here):
//
// - Cores. A launch runs one thread per core: a vector-only launch one per vector core
//   (GetBlockIdx in [0, blocks), one sub-core); a mix launch (KERNEL_TYPE_MIX_AIC_1_2), per AI
//   core, one cube thread (AIC) and one thread per vector sub-core (AIV, GetBlockIdx =
//   block * sub_num + sub). The counts come from the launch, which the AscendCL stand-in takes
//   from the device's reported topology.
// - The cube thread runs the kernel like every other core. REGIST_MATMUL_OBJ turns it into the
//   Matmul server of its AI core (as Ascend C's macro does on the AIC, which then returns);
//   Matmul::IterateAll on a vector sub-core sends its product to that server and waits. The
//   cube has no unified buffer and no vector unit: a DataCopyPad, vector op or UB allocation on
//   it fails the launch. So does a vector sub-core that registered a Matmul and ended without
//   End(), and a product nobody serves.
// - Pipes. DataCopyPad GM->UB is queued on MTE2, UB->GM on MTE3, vector ops on V; nothing in a
//   queue takes effect until the kernel synchronises: WaitFlag<A_B> runs pipe A up to its
//   SetFlag<A_B>; PipeBarrier<PIPE_ALL> (and the kernel's end) runs every pipe, consumers first
//   (MTE3, V, MTE2), the order that exposes a missing flag; vector ops between two
//   PipeBarrier<PIPE_V> run as one batch that reads all its sources before it writes (as
//   pipelined vector instructions may). A kernel that reads before the sync that orders the read
//   reads stale data, and gets a wrong result. The scalar unit runs in program order:
//   LocalTensor::GetValue / SetValue read and write the unified buffer at once, so a scalar read
//   of a vector result (or of a loaded tile) without SetFlag<V_S> (MTE2_S) / WaitFlag before it
//   reads what was there before.
// - Bounds. Every DataCopyPad, vector op, GetValue and SetValue is checked against its tensor's
//   extent (GlobalTensor's SetGlobalBuffer size, LocalTensor's part of its TBuf) and every global
//   access against the device allocations (aclrtMalloc'd or a PE's symmetric heap); the
//   unified buffer holds ub_bytes (192 KiB, as a 910B's). A DataCopyPad without padding leaves
//   the rest of each row's last 32-byte block as garbage (NaN bytes), never zero.
// - Ascend SHMEM. aclshmem_ptr maps an address of this PE's heap to a peer's;
//   aclshmemx_signal_op adds or sets atomically (release). In a mix kernel, a signal to another
//   PE, or a copy into another PE's heap, from a core other than vector sub-core 0 fails the
//   launch (the seed's rule: communication on sub_vec_id == 0).
// - Time. GetSystemCycle counts at 50 MHz of real time (the rate the host's timeouts assume).
//
// A rule broken is a launch failure naming the kernel, the core and the sub-core; the other
// threads of the launch stop at their next call here.
#pragma once

#include <sched.h>
#include <time.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../ascendc_types.h"
#include "../standin_launch_info.h"

#define __global__ __attribute__((visibility("default")))

enum event_t : int32_t { EVENT_ID0 = 0, EVENT_ID1 = 1, EVENT_ID2 = 2, EVENT_ID3 = 3 };

namespace standin {

enum class Kind { AIC, AIV };
enum Pipe { P_MTE2 = 0, P_V = 1, P_MTE3 = 2, P_COUNT = 3 };
static const char *const PIPE_NAMES[P_COUNT] = {"MTE2", "V", "MTE3"};

// A rule broken: ends the thread, fails the launch with this message.
struct Fault {
    std::string what;
};
// Another thread of the launch failed: this one stops quietly.
struct Abort {};

// One queued operation: run it (reading its sources), which returns the write to commit.
using Commit = std::function<void()>;
using Op = std::function<Commit()>;

struct Queue {
    std::vector<Op> ops;  // an empty Op marks a PipeBarrier of this pipe
    size_t done = 0;
};

struct CubeUnit;

struct Launch {
    const standin_launch_info *info;
    std::atomic<bool> failed{false};
    std::mutex lock;
    std::string error;
    std::vector<CubeUnit *> cubes;
};

struct Core {
    Launch *launch;
    Kind kind;
    int64_t block;      // the AI core (mix) or vector core (vector-only)
    int64_t sub;        // the vector sub-core (0 on the cube and in vector-only launches)
    int64_t block_idx;  // what GetBlockIdx answers
    int64_t block_num;
    int64_t sub_num;
    Queue queues[P_COUNT];
    std::map<std::pair<int, int>, std::vector<size_t>> flags;  // (event, id) -> set points
    std::vector<uint8_t> ub;
    size_t ub_used = 0;
    bool matmul_registered = false;
    bool matmul_ended = false;
    uint64_t spins = 0;
};

inline thread_local Core *tl_core = nullptr;

inline Core &core() { return *tl_core; }

inline std::string where() {
    Core &c = core();
    char text[160];
    if (!c.launch->info->mix) {
        snprintf(text, sizeof text, "kernel %s, vector core %lld", c.launch->info->kernel, (long long)c.block);
    } else if (c.kind == Kind::AIC) {
        snprintf(text, sizeof text, "kernel %s, AI core %lld, cube", c.launch->info->kernel, (long long)c.block);
    } else {
        snprintf(text, sizeof text, "kernel %s, AI core %lld, vector sub-core %lld", c.launch->info->kernel,
                 (long long)c.block, (long long)c.sub);
    }
    return text;
}

[[noreturn]] inline void fault(const std::string &what) { throw Fault{where() + ": " + what}; }

inline void check_abort() {
    if (core().launch->failed.load(std::memory_order_relaxed)) {
        throw Abort{};
    }
}

inline void need_vector(const char *what) {
    check_abort();
    if (core().kind == Kind::AIC) {
        fault(std::string(what) + " on the cube core, which has no unified buffer or vector unit");
    }
}

// The PE whose symmetric heap holds [p, p + len), or -1.
inline int heap_of(const void *p, size_t len) {
    const standin_launch_info *info = core().launch->info;
    const uint8_t *b = static_cast<const uint8_t *>(p);
    for (int pe = 0; pe < info->n_pes; ++pe) {
        const uint8_t *base = static_cast<const uint8_t *>(info->heaps[pe].base);
        if (base != nullptr && b >= base && b + len <= base + info->heaps[pe].size) {
            return pe;
        }
    }
    return -1;
}

// Whether this core may communicate: in a mix kernel only vector sub-core 0 does.
inline void need_comm_core(const char *what, int pe) {
    Core &c = core();
    if (c.launch->info->mix && (c.kind == Kind::AIC || c.sub != 0)) {
        char text[200];
        snprintf(text, sizeof text, "%s to PE %d from %s (communication belongs to vector sub-core 0)", what, pe,
                 c.kind == Kind::AIC ? "the cube core" : "a vector sub-core other than 0");
        fault(text);
    }
}

inline void gm_check(const void *p, size_t len, const char *what) {
    if (len == 0) {
        return;
    }
    if (!core().launch->info->gm_valid(p, len)) {
        char text[200];
        snprintf(text, sizeof text, "%s of %zu bytes at %p lies outside every device allocation", what, len, p);
        fault(text);
    }
}

// Runs queued ops [done, upto) of `pipe`. Vector ops between barriers run as one batch: every
// op reads its sources before any writes.
inline void flush(Pipe pipe, size_t upto) {
    Queue &q = core().queues[pipe];
    if (upto > q.ops.size()) {
        upto = q.ops.size();
    }
    std::vector<Commit> batch;
    auto commit = [&batch]() {
        for (Commit &c : batch) {
            if (c) {
                c();
            }
        }
        batch.clear();
    };
    while (q.done < upto) {
        Op &op = q.ops[q.done++];
        if (!op) {
            commit();
            continue;
        }
        batch.push_back(op());
        if (pipe != P_V) {
            commit();
        }
    }
    commit();
}

inline void flush_all() {
    // Consumers first: a store queued behind a load it depends on, with no flag between them,
    // runs before the load and stores stale data.
    for (Pipe p : {P_MTE3, P_V, P_MTE2}) {
        flush(p, core().queues[p].ops.size());
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

inline void enqueue(Pipe pipe, Op op) { core().queues[pipe].ops.push_back(std::move(op)); }

// ---- element conversions -------------------------------------------------------------------

inline float bf16_to_f32(uint16_t bits) {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

template <typename T>
inline float to_f32(T v) {
    if constexpr (std::is_same_v<T, bfloat16_t>) {
        return bf16_to_f32(v.bits);
    } else {
        return static_cast<float>(v);
    }
}

// The neighbours of a 16-bit float's bit pattern (toward +inf / -inf), for directed rounding.
inline uint16_t step16(uint16_t bits, bool up) {
    bool neg = (bits & 0x8000u) != 0;
    uint16_t mag = bits & 0x7fffu;
    if (mag == 0) {
        return up ? 0x0001 : 0x8001;
    }
    if (up != neg) {
        return static_cast<uint16_t>(bits + 1);
    }
    return static_cast<uint16_t>(bits - 1);
}

enum class Round { RINT, ROUND, FLOOR, CEIL, TRUNC };

template <typename T>
inline T from_f32(float x, Round mode) {
    if constexpr (std::is_same_v<T, float>) {
        return x;
    } else {
        uint16_t bits;
        auto value = [](uint16_t b) {
            if constexpr (std::is_same_v<T, bfloat16_t>) {
                return bf16_to_f32(b);
            } else {
                half h;
                memcpy(&h, &b, 2);
                return static_cast<float>(h);
            }
        };
        if constexpr (std::is_same_v<T, bfloat16_t>) {
            bits = f32_to_bf16_rne(x);
        } else {
            half h = static_cast<half>(x);  // round to nearest even
            memcpy(&bits, &h, 2);
        }
        float near = value(bits);
        if (mode != Round::RINT && std::isfinite(x) && std::isfinite(near) && near != x) {
            uint16_t lo = near < x ? bits : step16(bits, false);
            uint16_t hi = near > x ? bits : step16(bits, true);
            float lo_v = value(lo), hi_v = value(hi);
            switch (mode) {
                case Round::FLOOR: bits = lo; break;
                case Round::CEIL: bits = hi; break;
                case Round::TRUNC: bits = x > 0 ? lo : hi; break;
                case Round::ROUND:
                    if (x - lo_v != hi_v - x) {
                        bits = x - lo_v < hi_v - x ? lo : hi;
                    } else {
                        bits = x > 0 ? hi : lo;
                    }
                    break;
                default: break;
            }
        }
        T out;
        memcpy(&out, &bits, 2);
        return out;
    }
}

// ---- the Matmul server of one AI core ------------------------------------------------------

struct CubeUnit {
    std::mutex m;
    std::condition_variable cv;
    std::function<void()> job;
    bool job_done = false;
    bool busy = false;  // a client's product is in flight
    bool serving = false;
    bool cube_ended = false;
    int vectors_alive = 0;
    std::string job_error;
};

inline CubeUnit *my_cube() {
    Core &c = core();
    return c.launch->cubes.at(static_cast<size_t>(c.block));
}

// The cube thread, from REGIST_MATMUL_OBJ: serves the products of its vector sub-cores until
// they have all ended.
inline void serve_cube() {
    CubeUnit *cu = my_cube();
    std::unique_lock<std::mutex> lk(cu->m);
    cu->serving = true;
    cu->cv.notify_all();
    while (true) {
        cu->cv.wait_for(lk, std::chrono::milliseconds(20), [&] { return cu->job || cu->vectors_alive == 0; });
        if (core().launch->failed.load()) {
            throw Abort{};
        }
        if (cu->job) {
            std::function<void()> job = std::move(cu->job);
            cu->job = nullptr;
            lk.unlock();
            std::string error;
            try {
                job();
            } catch (Fault &f) {
                error = f.what;
            }
            lk.lock();
            cu->job_error = error;
            cu->job_done = true;
            cu->cv.notify_all();
        } else if (cu->vectors_alive == 0) {
            return;
        }
    }
}

// A vector sub-core's product, run by its AI core's cube thread; waits until it is done.
inline void run_on_cube(std::function<void()> job) {
    Core &c = core();
    if (!c.launch->info->mix || c.kind != Kind::AIV) {
        fault("a Matmul product outside a mix kernel's vector sub-cores (no cube to run it)");
    }
    CubeUnit *cu = my_cube();
    std::unique_lock<std::mutex> lk(cu->m);
    auto stuck = [&](const char *why) {
        if (core().launch->failed.load()) {
            throw Abort{};
        }
        if (cu->cube_ended && !cu->serving) {
            fault(std::string("Matmul::IterateAll with no cube to serve it: the AI core's cube ended "
                              "without reaching REGIST_MATMUL_OBJ (") +
                  why + ")");
        }
    };
    while (cu->busy) {
        cu->cv.wait_for(lk, std::chrono::milliseconds(20));
        stuck("waiting for the other sub-core's product");
    }
    cu->busy = true;
    cu->job = std::move(job);
    cu->job_done = false;
    cu->cv.notify_all();
    while (!cu->job_done) {
        cu->cv.wait_for(lk, std::chrono::milliseconds(20));
        try {
            stuck("the product was never taken");
        } catch (...) {
            cu->busy = false;
            cu->job = nullptr;
            throw;
        }
    }
    cu->busy = false;
    std::string error = std::move(cu->job_error);
    cu->cv.notify_all();
    if (!error.empty()) {
        fault("the cube's product failed: " + error);
    }
}

inline bool on_cube() { return core().kind == Kind::AIC; }

// ---- the launch -----------------------------------------------------------------------------

using Kernel24 = void (*)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

inline void run_core(Launch *launch, Kind kind, int64_t block, int64_t sub) {
    const standin_launch_info *info = launch->info;
    Core c;
    c.launch = launch;
    c.kind = kind;
    c.block = block;
    c.sub = sub;
    c.block_num = info->blocks;
    c.sub_num = info->mix ? info->sub_vec_num : 1;
    c.block_idx = info->mix && kind == Kind::AIV ? block * info->sub_vec_num + sub : block;
    c.ub.assign(kind == Kind::AIV ? info->ub_bytes : 0, 0xff);
    tl_core = &c;
    int64_t a[24] = {0};
    for (int i = 0; i < info->nargs && i < 24; ++i) {
        a[i] = info->args[i];
    }
    std::string error;
    try {
        // Every kernel parameter is a pointer or an int64_t, passed alike in integer registers
        // and stack slots: the caller may pass more than the callee reads.
        reinterpret_cast<Kernel24>(info->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
                                             a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20],
                                             a[21], a[22], a[23]);
        flush_all();  // the kernel's end: every queued operation completes
        if (c.matmul_registered && !c.matmul_ended) {
            fault("a Matmul was registered (REGIST_MATMUL_OBJ) and the sub-core ended without Matmul::End(): "
                  "the cube would serve it forever");
        }
    } catch (Fault &f) {
        error = f.what;
    } catch (Abort &) {
    }
    if (!error.empty()) {
        std::lock_guard<std::mutex> g(launch->lock);
        if (launch->error.empty()) {
            launch->error = error;
        }
        launch->failed.store(true);
    }
    if (info->mix) {
        CubeUnit *cu = launch->cubes[static_cast<size_t>(block)];
        std::lock_guard<std::mutex> g(cu->m);
        if (kind == Kind::AIV) {
            cu->vectors_alive--;
        } else {
            cu->cube_ended = true;
            cu->serving = false;
        }
        cu->cv.notify_all();
    }
    tl_core = nullptr;
}

}  // namespace standin

// The entry point the AscendCL stand-in calls: runs the kernel on every core, returns 0, or -1
// with the first rule broken in info->error.
extern "C" __attribute__((visibility("default"))) int standin_kernel_launch(standin_launch_info *info) {
    using namespace standin;
    Launch launch;
    launch.info = info;
    std::vector<CubeUnit> cubes(info->mix ? info->blocks : 0);
    for (CubeUnit &cu : cubes) {
        cu.vectors_alive = info->sub_vec_num;
        launch.cubes.push_back(&cu);
    }
    std::vector<std::thread> threads;
    for (uint32_t b = 0; b < info->blocks; ++b) {
        if (info->mix) {
            threads.emplace_back(run_core, &launch, Kind::AIC, b, 0);
            for (int s = 0; s < info->sub_vec_num; ++s) {
                threads.emplace_back(run_core, &launch, Kind::AIV, b, s);
            }
        } else {
            threads.emplace_back(run_core, &launch, Kind::AIV, b, 0);
        }
    }
    for (std::thread &t : threads) {
        t.join();
    }
    if (launch.failed.load()) {
        snprintf(info->error, info->error_len, "%s", launch.error.c_str());
        return -1;
    }
    return 0;
}

inline void kernel_task_type_default(KernelType type) {
    const bool mix = standin::core().launch->info->mix != 0;
    if ((type == KERNEL_TYPE_MIX_AIC_1_2) != mix) {
        standin::fault(std::string("the kernel declares ") +
                       (type == KERNEL_TYPE_MIX_AIC_1_2 ? "a mix (1:2) kernel" : "a vector-only kernel") +
                       " and was launched " + (mix ? "in mix mode" : "on the vector cores"));
    }
}
#define KERNEL_TASK_TYPE_DEFAULT(type) kernel_task_type_default(type)

inline thread_local GM_ADDR tl_sys_workspace = nullptr;
inline GM_ADDR GetSysWorkSpacePtr() { return tl_sys_workspace; }

#define ASCEND_IS_AIC (standin::on_cube())
#define ASCEND_IS_AIV (!standin::on_cube())

namespace AscendC {

inline int64_t GetBlockIdx() { return standin::core().block_idx; }
inline int64_t GetBlockNum() { return standin::core().block_num; }
inline int64_t GetSubBlockIdx() { return standin::core().sub; }
inline int64_t GetSubBlockNum() { return standin::core().sub_num; }

// The system counter, at 50 MHz of real time.
inline int64_t GetSystemCycle() {
    standin::check_abort();
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 50000000 + ts.tv_nsec / 20;
}

inline void SetSysWorkspace(GM_ADDR workspace) { tl_sys_workspace = workspace; }

enum class TPosition { GM, A1, B1, VECIN, VECOUT, VECCALC };
enum class HardEvent { MTE2_MTE3, MTE3_MTE2, MTE2_V, V_MTE2, V_MTE3, MTE3_V, MTE2_S, MTE3_S, V_S, S_MTE2, S_MTE3, S_V };
enum class RoundMode { CAST_NONE, CAST_RINT, CAST_ROUND, CAST_FLOOR, CAST_CEIL, CAST_TRUNC };
enum class CacheLine { SINGLE_CACHE_LINE, ENTIRE_DATA_CACHE };
enum class DcciDst { CACHELINE_ALL, CACHELINE_UB, CACHELINE_OUT, CACHELINE_ATOMIC };

// The pipe whose work an event's SetFlag marks (-1: the scalar unit, which runs in order).
constexpr int source_pipe(HardEvent e) {
    switch (e) {
        case HardEvent::MTE2_MTE3:
        case HardEvent::MTE2_V:
        case HardEvent::MTE2_S: return standin::P_MTE2;
        case HardEvent::MTE3_MTE2:
        case HardEvent::MTE3_V:
        case HardEvent::MTE3_S: return standin::P_MTE3;
        case HardEvent::V_MTE2:
        case HardEvent::V_MTE3:
        case HardEvent::V_S: return standin::P_V;
        default: return -1;
    }
}

template <HardEvent E>
inline void SetFlag(int32_t event) {
    standin::check_abort();
    constexpr int pipe = source_pipe(E);
    if (pipe < 0) {
        return;
    }
    standin::Core &c = standin::core();
    c.flags[{static_cast<int>(E), event}].push_back(c.queues[pipe].ops.size());
}

template <HardEvent E>
inline void WaitFlag(int32_t event) {
    standin::check_abort();
    constexpr int pipe = source_pipe(E);
    if (pipe < 0) {
        return;
    }
    standin::Core &c = standin::core();
    auto &points = c.flags[{static_cast<int>(E), event}];
    if (points.empty()) {
        standin::fault("WaitFlag with no SetFlag of the same event before it: the pipe would wait forever");
    }
    size_t upto = points.front();
    points.erase(points.begin());
    standin::flush(static_cast<standin::Pipe>(pipe), upto);
}

template <pipe_t P>
inline void PipeBarrier() {
    standin::check_abort();
    if constexpr (P == PIPE_ALL) {
        standin::flush_all();
    } else if constexpr (P == PIPE_V) {
        standin::enqueue(standin::P_V, standin::Op());
    } else if constexpr (P == PIPE_MTE2) {
        standin::enqueue(standin::P_MTE2, standin::Op());
    } else if constexpr (P == PIPE_MTE3) {
        standin::enqueue(standin::P_MTE3, standin::Op());
    }
}

template <typename T>
class GlobalTensor {
public:
    __gm__ T *ptr_ = nullptr;
    uint64_t size_ = 0;

    void SetGlobalBuffer(__gm__ T *buffer, uint64_t size) {
        ptr_ = buffer;
        size_ = size;
    }
    __gm__ T *GetPhyAddr() const { return ptr_; }
    uint64_t GetSize() const { return size_; }

    void check(uint64_t offset, uint64_t count, const char *what) const {
        if (offset + count > size_ || offset + count < offset) {
            char text[200];
            snprintf(text, sizeof text, "%s of elements [%llu, %llu) of a GlobalTensor of %llu", what,
                     (unsigned long long)offset, (unsigned long long)(offset + count), (unsigned long long)size_);
            standin::fault(text);
        }
        standin::gm_check(ptr_ + offset, count * sizeof(T), what);
    }

    // A scalar read of global memory, past the data cache (signals are read so).
    T GetValue(uint64_t offset) const {
        standin::check_abort();
        check(offset, 1, "GlobalTensor::GetValue");
        T out;
        if constexpr (sizeof(T) == 4 || sizeof(T) == 8) {
            __atomic_load(ptr_ + offset, &out, __ATOMIC_ACQUIRE);
        } else {
            out = ptr_[offset];
        }
        return out;
    }

    void SetValue(uint64_t offset, T value) {
        standin::check_abort();
        check(offset, 1, "GlobalTensor::SetValue");
        if constexpr (sizeof(T) == 4 || sizeof(T) == 8) {
            __atomic_store(ptr_ + offset, &value, __ATOMIC_RELEASE);
        } else {
            ptr_[offset] = value;
        }
    }

    GlobalTensor operator[](uint64_t offset) const {
        if (offset > size_) {
            char text[160];
            snprintf(text, sizeof text, "GlobalTensor[%llu] past its %llu elements", (unsigned long long)offset,
                     (unsigned long long)size_);
            standin::fault(text);
        }
        GlobalTensor t;
        t.ptr_ = ptr_ + offset;
        t.size_ = size_ - offset;
        return t;
    }
};

template <typename T>
class LocalTensor {
public:
    uint8_t *base_ = nullptr;  // the TBuf's first byte
    uint32_t offset_ = 0;      // bytes from base_
    uint32_t bytes_ = 0;       // bytes from offset_ to the TBuf's end

    T *addr() const { return reinterpret_cast<T *>(base_ + offset_); }
    uint32_t GetSize() const { return bytes_ / sizeof(T); }

    LocalTensor operator[](uint32_t offset) const {
        uint64_t at = static_cast<uint64_t>(offset) * sizeof(T);
        if (base_ == nullptr || at > bytes_) {
            char text[160];
            snprintf(text, sizeof text, "LocalTensor[%u] past its %u bytes of unified buffer", offset, bytes_);
            standin::fault(text);
        }
        LocalTensor t = *this;
        t.offset_ += static_cast<uint32_t>(at);
        t.bytes_ -= static_cast<uint32_t>(at);
        return t;
    }

    template <typename U>
    LocalTensor<U> ReinterpretCast() const {
        LocalTensor<U> t;
        t.base_ = base_;
        t.offset_ = offset_;
        t.bytes_ = bytes_;
        return t;
    }

    // A scalar read of the unified buffer by the scalar unit, in program order: what the buffer
    // holds now. A vector op or a copy still queued has not written it yet, so a kernel that reads
    // a vector result without SetFlag<V_S> / WaitFlag<V_S> (or a loaded tile without MTE2_S)
    // reads stale data, as on the hardware.
    T GetValue(const uint32_t index) const {
        standin::need_vector("LocalTensor::GetValue");
        check((static_cast<uint64_t>(index) + 1) * sizeof(T), "LocalTensor::GetValue");
        T out;
        memcpy(&out, addr() + index, sizeof(T));
        return out;
    }

    // A scalar write of the unified buffer, at once: a vector op or copy queued before it and run
    // later (no S_V / S_MTE3 flag between them) sees the new value, and one that the write was
    // meant to follow (no V_S / MTE3_S flag before it) overwrites it.
    void SetValue(const uint32_t index, const T value) const {
        standin::need_vector("LocalTensor::SetValue");
        check((static_cast<uint64_t>(index) + 1) * sizeof(T), "LocalTensor::SetValue");
        memcpy(addr() + index, &value, sizeof(T));
    }

    void check(uint64_t bytes, const char *what) const {
        if (base_ == nullptr) {
            standin::fault(std::string(what) + " on a LocalTensor with no buffer");
        }
        if (bytes > bytes_) {
            char text[200];
            snprintf(text, sizeof text, "%s of %llu bytes of unified buffer where the LocalTensor has %u", what,
                     (unsigned long long)bytes, bytes_);
            standin::fault(text);
        }
    }
};

template <TPosition P>
class TBuf {
public:
    uint8_t *base_ = nullptr;
    uint32_t bytes_ = 0;

    template <typename T>
    LocalTensor<T> Get() {
        if (base_ == nullptr) {
            standin::fault("TBuf::Get before TPipe::InitBuffer");
        }
        LocalTensor<T> t;
        t.base_ = base_;
        t.bytes_ = bytes_;
        return t;
    }
};

class TPipe {
public:
    TPipe() {
        if (standin::tl_core != nullptr) {
            standin::core().ub_used = 0;
        }
    }

    template <class B>
    void InitBuffer(B &buffer, uint32_t bytes) {
        standin::need_vector("TPipe::InitBuffer");
        standin::Core &c = standin::core();
        size_t at = (c.ub_used + 31) / 32 * 32;
        if (at + bytes > c.ub.size()) {
            char text[200];
            snprintf(text, sizeof text,
                     "TPipe::InitBuffer of %u bytes past the unified buffer (%zu bytes in use of %zu)", bytes, at,
                     c.ub.size());
            standin::fault(text);
        }
        buffer.base_ = c.ub.data() + at;
        buffer.bytes_ = bytes;
        c.ub_used = at + bytes;
    }
};

namespace detail {

// The rows of a DataCopyPad of `p` (on a vector core, checked): `rows` of `len` bytes, `gm_pitch`
// bytes apart in global memory (`gm_stride` bytes between rows), each taking `row_ub` bytes (whole
// 32-byte blocks) of the unified buffer, `ub_pitch` apart there (`ub_blocks` blocks between rows).
struct CopyRows {
    uint64_t rows, len, gm_pitch, row_ub, ub_pitch;
};

template <typename T>
CopyRows copy_rows(const DataCopyExtParams &p, uint32_t gm_stride, uint32_t ub_blocks) {
    standin::need_vector("DataCopyPad");
    if (p.blockCount == 0 || p.blockLen == 0) {
        standin::fault("DataCopyPad of an empty block (blockCount or blockLen 0)");
    }
    if (p.blockLen % sizeof(T) != 0 || gm_stride % sizeof(T) != 0) {
        standin::fault("DataCopyPad: a length or stride not a whole number of elements");
    }
    const uint64_t len = p.blockLen, row_ub = (len + 31) / 32 * 32;
    return {p.blockCount, len, len + gm_stride, row_ub, row_ub + 32ull * ub_blocks};
}

}  // namespace detail

// GM -> UB on MTE2: blockCount rows of blockLen bytes, srcStride bytes apart in global memory,
// each row starting on a 32-byte block of the unified buffer (dstStride blocks between rows).
template <typename T>
void DataCopyPad(const LocalTensor<T> &dst, const GlobalTensor<T> &src, const DataCopyExtParams &p,
                 const DataCopyPadExtParams<T> &pad) {
    const detail::CopyRows c = detail::copy_rows<T>(p, p.srcStride, p.dstStride);
    const uint64_t rows = c.rows, len = c.len, gm_pitch = c.gm_pitch, row_ub = c.row_ub, ub_pitch = c.ub_pitch;
    src.check(0, ((rows - 1) * gm_pitch + len) / sizeof(T), "DataCopyPad (GM -> UB) read");
    dst.check((rows - 1) * ub_pitch + row_ub, "DataCopyPad (GM -> UB) write");
    const uint8_t *from = reinterpret_cast<const uint8_t *>(src.ptr_);
    uint8_t *to = reinterpret_cast<uint8_t *>(dst.addr());
    const bool padded = pad.isPad;
    const T value = pad.paddingValue;
    standin::enqueue(standin::P_MTE2, [=]() -> standin::Commit {
        for (uint64_t r = 0; r < rows; ++r) {
            memcpy(to + r * ub_pitch, from + r * gm_pitch, len);
            uint8_t *tail = to + r * ub_pitch + len;
            if (padded) {
                for (uint64_t b = 0; b + sizeof(T) <= row_ub - len; b += sizeof(T)) {
                    memcpy(tail + b, &value, sizeof(T));
                }
            } else {
                memset(tail, 0xff, row_ub - len);  // not padded: whatever was there, never zero
            }
        }
        return nullptr;
    });
}

// UB -> GM on MTE3: blockCount rows of blockLen bytes, from 32-byte-aligned rows of the unified
// buffer (srcStride blocks between rows), dstStride bytes apart in global memory.
template <typename T>
void DataCopyPad(const GlobalTensor<T> &dst, const LocalTensor<T> &src, const DataCopyExtParams &p) {
    const detail::CopyRows c = detail::copy_rows<T>(p, p.dstStride, p.srcStride);
    const uint64_t rows = c.rows, len = c.len, gm_pitch = c.gm_pitch, ub_pitch = c.ub_pitch;
    dst.check(0, ((rows - 1) * gm_pitch + len) / sizeof(T), "DataCopyPad (UB -> GM) write");
    src.check((rows - 1) * ub_pitch + len, "DataCopyPad (UB -> GM) read");
    const int pe = standin::heap_of(dst.ptr_, (rows - 1) * gm_pitch + len);
    if (pe >= 0 && pe != standin::core().launch->info->my_pe) {
        standin::need_comm_core("a SHMEM put (DataCopyPad into a peer's symmetric heap)", pe);
    }
    uint8_t *to = reinterpret_cast<uint8_t *>(dst.ptr_);
    const uint8_t *from = reinterpret_cast<const uint8_t *>(src.addr());
    standin::enqueue(standin::P_MTE3, [=]() -> standin::Commit {
        for (uint64_t r = 0; r < rows; ++r) {
            memcpy(to + r * gm_pitch, from + r * ub_pitch, len);
        }
        return nullptr;
    });
}

// ---- vector ops (V pipe) -----------------------------------------------------------------------

namespace detail {
template <typename T, typename F>
void vector_op(const char *name, const LocalTensor<T> &dst, std::vector<LocalTensor<T>> srcs, int32_t count, F f) {
    standin::need_vector(name);
    if (count < 0) {
        standin::fault(std::string(name) + " with a negative count");
    }
    const uint64_t bytes = static_cast<uint64_t>(count) * sizeof(T);
    dst.check(bytes, name);
    for (const LocalTensor<T> &s : srcs) {
        s.check(bytes, name);
    }
    T *out = dst.addr();
    standin::enqueue(standin::P_V, [=]() -> standin::Commit {
        std::vector<T> result(static_cast<size_t>(count));
        for (int32_t i = 0; i < count; ++i) {
            result[static_cast<size_t>(i)] = f(srcs, i);
        }
        return [out, result = std::move(result)]() { memcpy(out, result.data(), result.size() * sizeof(T)); };
    });
}

template <typename T>
T arith(float v) {
    return standin::from_f32<T>(v, standin::Round::RINT);
}
}  // namespace detail

template <typename T>
void Add(const LocalTensor<T> &dst, const LocalTensor<T> &src0, const LocalTensor<T> &src1, const int32_t &count) {
    detail::vector_op("Add", dst, {src0, src1}, count, [](const std::vector<LocalTensor<T>> &s, int32_t i) {
        return detail::arith<T>(standin::to_f32(s[0].addr()[i]) + standin::to_f32(s[1].addr()[i]));
    });
}

template <typename T>
void Adds(const LocalTensor<T> &dst, const LocalTensor<T> &src, const T &scalar, const int32_t &count) {
    const float k = standin::to_f32(scalar);
    detail::vector_op("Adds", dst, {src}, count, [k](const std::vector<LocalTensor<T>> &s, int32_t i) {
        return detail::arith<T>(standin::to_f32(s[0].addr()[i]) + k);
    });
}

template <typename T>
void Muls(const LocalTensor<T> &dst, const LocalTensor<T> &src, const T &scalar, const int32_t &count) {
    const float k = standin::to_f32(scalar);
    detail::vector_op("Muls", dst, {src}, count, [k](const std::vector<LocalTensor<T>> &s, int32_t i) {
        return detail::arith<T>(standin::to_f32(s[0].addr()[i]) * k);
    });
}

// The ops below (flash_decode's) also check Ascend C's general address alignment rule: every
// vector operand starts on a 32-byte block of the unified buffer.
namespace detail {
template <typename T>
void need_aligned(const char *name, const LocalTensor<T> &t) {
    if (t.base_ != nullptr && t.offset_ % 32 != 0) {
        char text[200];
        snprintf(text, sizeof text, "%s with an operand %u bytes into its buffer, not on a 32-byte block", name,
                 t.offset_);
        standin::fault(text);
    }
}

template <typename T, typename F>
void aligned_vector_op(const char *name, const LocalTensor<T> &dst, std::vector<LocalTensor<T>> srcs, int32_t count,
                       F f) {
    standin::need_vector(name);
    need_aligned(name, dst);
    for (const LocalTensor<T> &s : srcs) {
        need_aligned(name, s);
    }
    vector_op(name, dst, std::move(srcs), count, f);
}
}  // namespace detail

// dst[i] = src0[i] * src1[i].
template <typename T>
void Mul(const LocalTensor<T> &dst, const LocalTensor<T> &src0, const LocalTensor<T> &src1, const int32_t &count) {
    detail::aligned_vector_op("Mul", dst, {src0, src1}, count, [](const std::vector<LocalTensor<T>> &s, int32_t i) {
        return detail::arith<T>(standin::to_f32(s[0].addr()[i]) * standin::to_f32(s[1].addr()[i]));
    });
}

// dst[i] = exp(src[i]).
template <typename T>
void Exp(const LocalTensor<T> &dst, const LocalTensor<T> &src, const int32_t &count) {
    detail::aligned_vector_op("Exp", dst, {src}, count, [](const std::vector<LocalTensor<T>> &s, int32_t i) {
        return detail::arith<T>(std::exp(standin::to_f32(s[0].addr()[i])));
    });
}

// dst[i] = ln(src[i]) (minus infinity at 0, NaN below).
template <typename T>
void Ln(const LocalTensor<T> &dst, const LocalTensor<T> &src, const int32_t &count) {
    detail::aligned_vector_op("Ln", dst, {src}, count, [](const std::vector<LocalTensor<T>> &s, int32_t i) {
        return detail::arith<T>(std::log(standin::to_f32(s[0].addr()[i])));
    });
}

// dst[i] = src[i] * scalar + dst[i] (the product rounded, then the sum): dst is read as well as
// written, src may be of a narrower type (U) than dst (T).
template <typename T, typename U>
void Axpy(const LocalTensor<T> &dst, const LocalTensor<U> &src, const U &scalarValue, const int32_t &count) {
    standin::need_vector("Axpy");
    detail::need_aligned("Axpy", dst);
    detail::need_aligned("Axpy", src);
    if (count < 0) {
        standin::fault("Axpy with a negative count");
    }
    dst.check(static_cast<uint64_t>(count) * sizeof(T), "Axpy");
    src.check(static_cast<uint64_t>(count) * sizeof(U), "Axpy");
    const float k = standin::to_f32(scalarValue);
    T *out = dst.addr();
    const U *in = src.addr();
    standin::enqueue(standin::P_V, [=]() -> standin::Commit {
        std::vector<T> result(static_cast<size_t>(count));
        for (int32_t i = 0; i < count; ++i) {
            const float product = standin::to_f32(detail::arith<T>(standin::to_f32(in[i]) * k));
            result[static_cast<size_t>(i)] = detail::arith<T>(product + standin::to_f32(out[i]));
        }
        return [out, result = std::move(result)]() { memcpy(out, result.data(), result.size() * sizeof(T)); };
    });
}

// dst[0] = the sum of src[0 .. count), as the "first n elements" form sums on an A2/A3: a binary
// tree within each repeat (256 bytes of src: data0 + data1, data2 + data3, ..., then the pairs'
// sums), the repeats' sums added in order. sharedTmpBuffer must hold the documented minimum
// (one element per repeat, rounded up to a 32-byte block); it is not written here.
template <typename T, bool isSetMask = true>
void ReduceSum(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<T> &sharedTmpBuffer,
               const int32_t count) {
    standin::need_vector("ReduceSum");
    detail::need_aligned("ReduceSum", dst);
    detail::need_aligned("ReduceSum", src);
    detail::need_aligned("ReduceSum", sharedTmpBuffer);
    if (count <= 0) {
        standin::fault("ReduceSum of no elements");
    }
    const int64_t per_repeat = 256 / static_cast<int64_t>(sizeof(T));
    const int64_t per_block = 32 / static_cast<int64_t>(sizeof(T));
    const int64_t repeats = (count + per_repeat - 1) / per_repeat;
    const int64_t work = (repeats + per_block - 1) / per_block * per_block;
    dst.check(sizeof(T), "ReduceSum");
    src.check(static_cast<uint64_t>(count) * sizeof(T), "ReduceSum");
    sharedTmpBuffer.check(static_cast<uint64_t>(work) * sizeof(T), "ReduceSum sharedTmpBuffer");
    T *out = dst.addr();
    const T *in = src.addr();
    standin::enqueue(standin::P_V, [=]() -> standin::Commit {
        std::vector<float> lanes(static_cast<size_t>(per_repeat));
        float total = 0.0f;
        for (int64_t r = 0; r < repeats; ++r) {
            for (int64_t i = 0; i < per_repeat; ++i) {
                const int64_t at = r * per_repeat + i;
                lanes[static_cast<size_t>(i)] = at < count ? standin::to_f32(in[at]) : 0.0f;
            }
            for (int64_t width = per_repeat; width > 1; width /= 2) {
                for (int64_t i = 0; i < width / 2; ++i) {
                    const float pair = lanes[static_cast<size_t>(2 * i)] + lanes[static_cast<size_t>(2 * i + 1)];
                    lanes[static_cast<size_t>(i)] = standin::to_f32(detail::arith<T>(pair));
                }
            }
            total = r == 0 ? lanes[0] : standin::to_f32(detail::arith<T>(total + lanes[0]));
        }
        const T result = detail::arith<T>(total);
        return [out, result]() { memcpy(out, &result, sizeof(T)); };
    });
}

// Cast: exact where the types allow; otherwise rounded as `mode` says (CAST_NONE rounds to
// nearest even where a conversion loses precision, as Ascend C documents it).
template <typename D, typename S>
void Cast(const LocalTensor<D> &dst, const LocalTensor<S> &src, const RoundMode &mode, const uint32_t count) {
    standin::need_vector("Cast");
    dst.check(static_cast<uint64_t>(count) * sizeof(D), "Cast");
    src.check(static_cast<uint64_t>(count) * sizeof(S), "Cast");
    standin::Round r = standin::Round::RINT;
    switch (mode) {
        case RoundMode::CAST_ROUND: r = standin::Round::ROUND; break;
        case RoundMode::CAST_FLOOR: r = standin::Round::FLOOR; break;
        case RoundMode::CAST_CEIL: r = standin::Round::CEIL; break;
        case RoundMode::CAST_TRUNC: r = standin::Round::TRUNC; break;
        default: break;
    }
    D *out = dst.addr();
    const S *in = src.addr();
    standin::enqueue(standin::P_V, [=]() -> standin::Commit {
        std::vector<D> result(count);
        for (uint32_t i = 0; i < count; ++i) {
            result[i] = standin::from_f32<D>(standin::to_f32(in[i]), r);
        }
        return [out, result = std::move(result)]() { memcpy(out, result.data(), result.size() * sizeof(D)); };
    });
}

// Cache maintenance: nothing to clean on a host, but a spinning reader gives the others the CPU.
template <typename T, CacheLine L, DcciDst D>
void DataCacheCleanAndInvalid(const GlobalTensor<T> &tensor) {
    (void)tensor;
    standin::check_abort();
    // Hundreds of cores share a few CPUs: after a few turns a spinning core sleeps between
    // reads, leaving the CPUs to the cores that have work.
    standin::Core &c = standin::core();
    if (++c.spins < 8) {
        sched_yield();
    } else {
        timespec nap{0, 50000};
        nanosleep(&nap, nullptr);
    }
}

}  // namespace AscendC
