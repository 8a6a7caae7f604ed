// TEST STAND-IN, NOT ASCEND C: the high-level Matmul API (`lib/matmul_intf.h`) the kernels use,
// on the CPU (see kernel_operator.h beside this file). A product C = A x B of the single shape
// (m x n, over k), A row-major with the original K as its row stride, B and C with the original
// N, accumulated in f32 in order of k and rounded once to C's type (to nearest even). It runs
// on the AI core's cube thread, which serves it from REGIST_MATMUL_OBJ; the tiling is checked
// against the single shape and the L0 buffers of a 910B (64 KiB L0A and L0B, 128 KiB L0C).
#pragma once

#include "../kernel_operator.h"
#include "../../ascendc_matmul_type.h"

namespace matmul {

template <class A, class B, class C, class Bias>
class Matmul {
public:
    using TA = typename A::Type;
    using TB = typename B::Type;
    using TC = typename C::Type;

    const TCubeTiling *tiling_ = nullptr;
    int org_m_ = 0, org_n_ = 0, org_k_ = 0;
    int m_ = 0, n_ = 0, k_ = 0;
    AscendC::GlobalTensor<TA> a_;
    AscendC::GlobalTensor<TB> b_;

    void SetOrgShape(int org_m, int org_n, int org_k) {
        org_m_ = org_m;
        org_n_ = org_n;
        org_k_ = org_k;
    }
    void SetSingleShape(int single_m, int single_n, int single_k) {
        m_ = single_m;
        n_ = single_n;
        k_ = single_k;
    }
    void SetTensorA(const AscendC::GlobalTensor<TA> &a) { a_ = a; }
    void SetTensorB(const AscendC::GlobalTensor<TB> &b) { b_ = b; }

    void IterateAll(const AscendC::GlobalTensor<TC> &c) {
        standin::check_abort();
        standin::Core &core = standin::core();
        if (!core.matmul_registered || core.matmul_ended) {
            standin::fault("Matmul::IterateAll on a Matmul not registered (REGIST_MATMUL_OBJ) or already ended");
        }
        const TCubeTiling &t = *tiling_;
        if (m_ <= 0 || n_ <= 0 || k_ <= 0) {
            standin::fault("Matmul::IterateAll with an empty single shape");
        }
        if (m_ > t.singleCoreM || n_ > t.singleCoreN || k_ > t.singleCoreK) {
            char text[200];
            snprintf(text, sizeof text, "Matmul single shape %d x %d x %d exceeds the tiling's %d x %d x %d", m_, n_,
                     k_, t.singleCoreM, t.singleCoreN, t.singleCoreK);
            standin::fault(text);
        }
        if (org_k_ != t.Ka || org_n_ != t.N) {
            standin::fault("Matmul original shape disagrees with the tiling's");
        }
        const uint64_t K = static_cast<uint64_t>(org_k_), N = static_cast<uint64_t>(org_n_);
        const uint64_t m = static_cast<uint64_t>(m_), n = static_cast<uint64_t>(n_), k = static_cast<uint64_t>(k_);
        a_.check(0, (m - 1) * K + k, "Matmul A read");
        b_.check(0, (k - 1) * N + n, "Matmul B read");
        c.check(0, (m - 1) * N + n, "Matmul C write");
        const TA *a = a_.ptr_;
        const TB *b = b_.ptr_;
        TC *out = c.ptr_;
        standin::run_on_cube([=]() {
            std::vector<float> row(n);
            for (uint64_t i = 0; i < m; ++i) {
                std::fill(row.begin(), row.end(), 0.0f);
                for (uint64_t kk = 0; kk < k; ++kk) {
                    const float av = standin::to_f32(a[i * K + kk]);
                    const TB *brow = b + kk * N;
                    for (uint64_t j = 0; j < n; ++j) {
                        row[j] += av * standin::to_f32(brow[j]);
                    }
                }
                for (uint64_t j = 0; j < n; ++j) {
                    out[i * N + j] = standin::from_f32<TC>(row[j], standin::Round::RINT);
                }
            }
        });
    }

    void End() {
        standin::check_abort();
        standin::core().matmul_ended = true;
    }
};

template <class M>
void regist_matmul_obj(AscendC::TPipe *pipe, GM_ADDR workspace, M &mm, const TCubeTiling *tiling) {
    (void)pipe;
    (void)workspace;
    standin::Core &core = standin::core();
    if (!core.launch->info->mix) {
        standin::fault("REGIST_MATMUL_OBJ in a kernel not launched in mix mode (no cube)");
    }
    using TA = typename M::TA;
    using TB = typename M::TB;
    const TCubeTiling &t = *tiling;
    const uint64_t l0a = static_cast<uint64_t>(t.baseM) * t.baseK * sizeof(TA) * (t.dbL0A > 0 ? t.dbL0A : 1);
    const uint64_t l0b = static_cast<uint64_t>(t.baseK) * t.baseN * sizeof(TB) * (t.dbL0B > 0 ? t.dbL0B : 1);
    const uint64_t l0c = static_cast<uint64_t>(t.baseM) * t.baseN * 4 * (t.dbL0C > 0 ? t.dbL0C : 1);
    if (t.baseM <= 0 || t.baseN <= 0 || t.baseK <= 0 || l0a > 65536 || l0b > 65536 || l0c > 131072) {
        char text[200];
        snprintf(text, sizeof text, "TCubeTiling base blocks %d x %d x %d do not fit L0 (A %llu, B %llu, C %llu bytes)",
                 t.baseM, t.baseN, t.baseK, (unsigned long long)l0a, (unsigned long long)l0b,
                 (unsigned long long)l0c);
        standin::fault(text);
    }
    mm.tiling_ = tiling;
    core.matmul_registered = true;
    core.matmul_ended = false;
}

}  // namespace matmul

// On the cube core: serve this AI core's products until its vector sub-cores end, then leave
// the kernel (as Ascend C's macro does on the AIC). On a vector sub-core: register the client.
#define REGIST_MATMUL_OBJ(pipe, workspace, mm, tiling)         \
    do {                                                       \
        if (standin::on_cube()) {                              \
            standin::serve_cube();                             \
            return;                                            \
        }                                                      \
        matmul::regist_matmul_obj(pipe, workspace, mm, tiling); \
    } while (0)
