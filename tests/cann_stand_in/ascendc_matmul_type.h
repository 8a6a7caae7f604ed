// TEST SURFACE, NOT ASCEND C: Ascend C's `matmul::MatmulType` (of `lib/matmul_intf.h`), which the
// declared surface (ascendc/lib/) and its CPU implementation (ascendc_cpu/lib/) declare alike,
// written once and included by both after kernel_operator.h (TPosition, CubeFormat).
#pragma once

namespace matmul {

template <AscendC::TPosition P, CubeFormat F, typename T>
struct MatmulType {
    using Type = T;
};

}  // namespace matmul
