// TEST SURFACE, NOT ASCEND C: the subset of Ascend C's high-level Matmul API
// (`lib/matmul_intf.h`) the kernels use. See kernel_operator.h beside this file.
#pragma once

#include "kernel_operator.h"
#include "../../ascendc_matmul_type.h"

namespace matmul {

template <class A, class B, class C, class Bias>
class Matmul {
public:
    void SetOrgShape(int org_m, int org_n, int org_k);
    void SetSingleShape(int single_m, int single_n, int single_k);
    void SetTensorA(const AscendC::GlobalTensor<typename A::Type> &a);
    void SetTensorB(const AscendC::GlobalTensor<typename B::Type> &b);
    void IterateAll(const AscendC::GlobalTensor<typename C::Type> &c);
    void End();
};

template <class M>
void regist_matmul_obj(AscendC::TPipe *pipe, GM_ADDR workspace, M &mm, const TCubeTiling *tiling);

}  // namespace matmul

#define REGIST_MATMUL_OBJ(pipe, workspace, mm, tiling) matmul::regist_matmul_obj(pipe, workspace, mm, tiling)
