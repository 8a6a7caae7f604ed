// TEST SURFACE, NOT ASCEND C. The subset of Ascend C's device API (`kernel_operator.h`) that
// dist-tensor's kernels (src/device/ascend/kernels/) use, declared with the signatures of the
// Ascend C API reference (CANN 8.3), and nothing defined: the tests compile every kernel source
// against it with the host C++ compiler (-fsyntax-only), which catches C++ errors and calls the
// declared surface lacks, not what only the real bisheng compiler knows (device placement,
// intrinsic constraints, buffer sizes). Used only by tests/ascend_kernels.rs.
#pragma once

#include <cstdint>

#include "../ascendc_types.h"

#define __global__

void kernel_task_type_default(KernelType type);
#define KERNEL_TASK_TYPE_DEFAULT(type) kernel_task_type_default(type)

enum event_t : int32_t { EVENT_ID0 = 0, EVENT_ID1 = 1 };

GM_ADDR GetSysWorkSpacePtr();

namespace AscendC {

int64_t GetBlockIdx();
int64_t GetBlockNum();
int64_t GetSubBlockIdx();
int64_t GetSubBlockNum();
int64_t GetSystemCycle();
void SetSysWorkspace(GM_ADDR workspace);

enum class TPosition { GM, A1, B1, VECIN, VECOUT, VECCALC };
enum class HardEvent { MTE2_MTE3, MTE3_MTE2, MTE2_V, V_MTE2, V_MTE3, MTE3_V, MTE2_S, MTE3_S, V_S, S_MTE2, S_MTE3, S_V };
enum class RoundMode { CAST_NONE, CAST_RINT, CAST_ROUND, CAST_FLOOR, CAST_CEIL };
enum class CacheLine { SINGLE_CACHE_LINE, ENTIRE_DATA_CACHE };
enum class DcciDst { CACHELINE_ALL, CACHELINE_UB, CACHELINE_OUT, CACHELINE_ATOMIC };

template <HardEvent E>
void SetFlag(int32_t event);
template <HardEvent E>
void WaitFlag(int32_t event);
template <pipe_t P>
void PipeBarrier();

template <typename T>
class GlobalTensor {
public:
    void SetGlobalBuffer(__gm__ T *buffer, uint64_t size);
    T GetValue(uint64_t offset) const;
    void SetValue(uint64_t offset, T value);
    GlobalTensor operator[](uint64_t offset) const;
};

template <typename T>
class LocalTensor {
public:
    LocalTensor operator[](uint32_t offset) const;
    template <typename U>
    LocalTensor<U> ReinterpretCast() const;
    T GetValue(const uint32_t index) const;
    void SetValue(const uint32_t index, const T value) const;
};

template <TPosition P>
class TBuf {
public:
    template <typename T>
    LocalTensor<T> Get();
};

class TPipe {
public:
    template <class B>
    void InitBuffer(B &buffer, uint32_t bytes);
};

template <typename T>
void DataCopyPad(const LocalTensor<T> &dst, const GlobalTensor<T> &src, const DataCopyExtParams &params,
                 const DataCopyPadExtParams<T> &pad);
template <typename T>
void DataCopyPad(const GlobalTensor<T> &dst, const LocalTensor<T> &src, const DataCopyExtParams &params);

template <typename T>
void Add(const LocalTensor<T> &dst, const LocalTensor<T> &src0, const LocalTensor<T> &src1, const int32_t &count);
template <typename T>
void Adds(const LocalTensor<T> &dst, const LocalTensor<T> &src, const T &scalar, const int32_t &count);
template <typename T>
void Muls(const LocalTensor<T> &dst, const LocalTensor<T> &src, const T &scalar, const int32_t &count);
template <typename T>
void Mul(const LocalTensor<T> &dst, const LocalTensor<T> &src0, const LocalTensor<T> &src1, const int32_t &count);
template <typename T>
void Exp(const LocalTensor<T> &dst, const LocalTensor<T> &src, const int32_t &count);
template <typename T>
void Ln(const LocalTensor<T> &dst, const LocalTensor<T> &src, const int32_t &count);
template <typename T, typename U>
void Axpy(const LocalTensor<T> &dst, const LocalTensor<U> &src, const U &scalarValue, const int32_t &count);
template <typename T, bool isSetMask = true>
void ReduceSum(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<T> &sharedTmpBuffer,
               const int32_t count);
template <typename D, typename S>
void Cast(const LocalTensor<D> &dst, const LocalTensor<S> &src, const RoundMode &mode, const uint32_t count);

template <typename T, CacheLine L, DcciDst D>
void DataCacheCleanAndInvalid(const GlobalTensor<T> &tensor);

}  // namespace AscendC
