// Sequence-parallel flash-decode, fused: the Ascend C twin of src/device/host/flash_decode.rs (the
// op, its agreement and its unfused baseline: src/fused/flash_decode.rs).
//
// One launch, two phases, no host barrier between them. A task of the first phase is one
// (batch, chunk of this rank's keys): for each kv head, the chunk's keys and values and the
// group's query rows are loaded into the unified buffer (widened to f32), and each query head of
// the group gets one record [o (dv values), lse] in f32: scores s_j = scale * q . k_j,
// m = max s_j, p_j = exp(s_j - m), l = sum p_j, o = (sum p_j v_j) / l, lse = m + ln(l). The
// group's records go straight into every rank's symmetric receive buffer (peers rotated, this
// rank too), at the place the agreed key counts give them; each program then adds the number of
// tasks it finished to each rank's signal for this source. A task of the second phase is one
// (batch, head): once every source with keys has signalled its full count (the cumulative value
// the host computed), it combines that row's records in rank order and chunk order (online
// log-sum-exp, records of no keys skipped), so that every rank computes the same bits, rounds the
// output once and stores its log-sum-exp.
//
// The chunk of keys per task and the records the combine loads at once are the host's
// (flash_decode.rs), cut so that the buffers below fit UB_DECODE_BYTES. Vector-only kernel: one
// program per vector core, every one of them communicating.
#include "prelude.h"

using namespace dt;

// Bytes of the unified buffer the kernel carves (flash_decode.rs holds the same number, and sizes
// the chunks to fit it with the same layout as carve_phase1 / carve_phase2 below).
constexpr uint32_t UB_DECODE_BYTES = 160 * 1024;

constexpr float NEG_INF = -__builtin_huge_valf();

// The agreed shapes and the host's cuts.
struct Dims {
    int64_t world, batch, heads, kv_heads, group, d, dv, keys, chunk, record_rows;
    int64_t pd, pv, pr;  // UB row pitches (elements): a key row, a value row, a record
};

// Consecutive parts of the unified buffer, each starting on a 32-byte block.
struct Carver {
    AscendC::LocalTensor<uint8_t> ub;
    int64_t at;

    template <typename T>
    __aicore__ inline AscendC::LocalTensor<T> take(int64_t elems) {
        AscendC::LocalTensor<T> part = ub[static_cast<uint32_t>(at)].template ReinterpretCast<T>();
        at += ceil_div(elems * static_cast<int64_t>(sizeof(T)), 32) * 32;
        return part;
    }
};

// The first phase's buffers. With f32 elements the raw tiles are the f32 ones (loaded in place).
struct Phase1 {
    AscendC::LocalTensor<acc_t> qf, kf, vf, prod, slots, scores, work, tiny, stage;
    AscendC::LocalTensor<elem_t> qraw, kraw, vraw;
};

// The second phase's buffers (over the first phase's: the phases are apart by a PIPE_ALL barrier).
struct Phase2 {
    AscendC::LocalTensor<acc_t> recs, acc, tiny, lse_slot;
    AscendC::LocalTensor<elem_t> oraw;
};

// Elements of work ReduceSum needs for sums of up to `count` floats: one per 64-float repeat, on
// whole 32-byte blocks.
__aicore__ inline int64_t reduce_work(int64_t count) { return ceil_div(ceil_div(count, 64), 8) * 8; }

__aicore__ inline Phase1 carve_phase1(AscendC::LocalTensor<uint8_t> &ub, const Dims &s) {
    const bool widen = sizeof(elem_t) != sizeof(acc_t);
    Carver c{ub, 0};
    Phase1 p;
    p.qf = c.take<acc_t>(s.group * s.pd);
    p.qraw = widen ? c.take<elem_t>(s.group * s.pd) : p.qf.ReinterpretCast<elem_t>();
    p.kf = c.take<acc_t>(s.chunk * s.pd);
    p.kraw = widen ? c.take<elem_t>(s.chunk * s.pd) : p.kf.ReinterpretCast<elem_t>();
    p.vf = c.take<acc_t>(s.chunk * s.pv);
    p.vraw = widen ? c.take<elem_t>(s.chunk * s.pv) : p.vf.ReinterpretCast<elem_t>();
    p.prod = c.take<acc_t>(s.chunk * s.pd);
    p.slots = c.take<acc_t>(s.chunk * 8);  // one score per 32-byte block: ReduceSum's destination
    p.scores = c.take<acc_t>(s.chunk);
    p.work = c.take<acc_t>(reduce_work(s.d > s.chunk ? s.d : s.chunk));
    p.tiny = c.take<acc_t>(16);
    p.stage = c.take<acc_t>(s.group * s.pr);
    return p;
}

__aicore__ inline Phase2 carve_phase2(AscendC::LocalTensor<uint8_t> &ub, const Dims &s) {
    const bool widen = sizeof(elem_t) != sizeof(acc_t);
    Carver c{ub, 0};
    Phase2 p;
    p.recs = c.take<acc_t>(s.record_rows * s.pr);
    p.acc = c.take<acc_t>(s.pv);
    p.oraw = widen ? c.take<elem_t>(s.pv) : p.acc.ReinterpretCast<elem_t>();
    p.tiny = c.take<acc_t>(16);
    p.lse_slot = c.take<acc_t>(8);
    return p;
}

// The scale, from the bits of an f32 (how the host passes it).
__aicore__ inline float float_from_bits(int64_t bits) {
    union {
        uint32_t u;
        float f;
    } v;
    v.u = static_cast<uint32_t>(bits);
    return v.f;
}

// The records of one kv head's query heads for one task into p.stage (row i: query head
// group * g + i): `q_rows` the group's query rows, `k_rows` / `v_rows` the chunk's `n` keys and
// values of the kv head (a row of every kv head apart).
__aicore__ inline void group_records(Phase1 &p, const Dims &s, __gm__ elem_t *q_rows, __gm__ elem_t *k_rows,
                                     __gm__ elem_t *v_rows, int64_t n, float scale) {
    // The tiles are free once the last group's vector work is done with them.
    AscendC::SetFlag<AscendC::HardEvent::V_MTE2>(EVENT_ID0);
    AscendC::WaitFlag<AscendC::HardEvent::V_MTE2>(EVENT_ID0);
    if (s.d > 0) {
        load_2d(p.qraw, q_rows, s.d, s.group, s.d);
        load_2d(p.kraw, k_rows, s.kv_heads * s.d, n, s.d);
    }
    if (s.dv > 0) {
        load_2d(p.vraw, v_rows, s.kv_heads * s.dv, n, s.dv);
    }
    AscendC::SetFlag<AscendC::HardEvent::MTE2_V>(EVENT_ID0);
    AscendC::WaitFlag<AscendC::HardEvent::MTE2_V>(EVENT_ID0);
    if (sizeof(elem_t) != sizeof(acc_t)) {
        // Half rows and f32 rows have the same pitch in elements: one cast per tile.
        AscendC::Cast(p.qf, p.qraw, AscendC::RoundMode::CAST_NONE, static_cast<uint32_t>(s.group * s.pd));
        AscendC::Cast(p.kf, p.kraw, AscendC::RoundMode::CAST_NONE, static_cast<uint32_t>(n * s.pd));
        AscendC::Cast(p.vf, p.vraw, AscendC::RoundMode::CAST_NONE, static_cast<uint32_t>(n * s.pv));
        AscendC::PipeBarrier<PIPE_V>();
    }
    AscendC::Muls(p.qf, p.qf, scale, static_cast<int32_t>(s.group * s.pd));  // scores come out scaled
    AscendC::PipeBarrier<PIPE_V>();
    for (int64_t i = 0; i < s.group; ++i) {
        AscendC::LocalTensor<acc_t> query = p.qf[static_cast<uint32_t>(i * s.pd)];
        if (s.d > 0) {
            for (int64_t j = 0; j < n; ++j) {
                const uint32_t row = static_cast<uint32_t>(j * s.pd);
                AscendC::Mul(p.prod[row], query, p.kf[row], static_cast<int32_t>(s.d));
            }
            AscendC::PipeBarrier<PIPE_V>();
            for (int64_t j = 0; j < n; ++j) {
                const uint32_t row = static_cast<uint32_t>(j * s.pd);
                AscendC::ReduceSum(p.slots[static_cast<uint32_t>(j * 8)], p.prod[row], p.work,
                                   static_cast<int32_t>(s.d));
                AscendC::PipeBarrier<PIPE_V>();  // the next sum shares the work buffer
            }
        }
        // The scores side by side, and their maximum, on the scalar unit.
        AscendC::SetFlag<AscendC::HardEvent::V_S>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::V_S>(EVENT_ID0);
        float top = NEG_INF;
        for (int64_t j = 0; j < n; ++j) {
            const float score = s.d > 0 ? p.slots.GetValue(static_cast<uint32_t>(j * 8)) : 0.0f;
            p.scores.SetValue(static_cast<uint32_t>(j), score);
            top = score > top ? score : top;
        }
        AscendC::SetFlag<AscendC::HardEvent::S_V>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::S_V>(EVENT_ID0);
        // p_j = exp(s_j - m), l = sum p_j, ln(l).
        AscendC::Adds(p.scores, p.scores, -top, static_cast<int32_t>(n));
        AscendC::PipeBarrier<PIPE_V>();
        AscendC::Exp(p.scores, p.scores, static_cast<int32_t>(n));
        AscendC::PipeBarrier<PIPE_V>();
        AscendC::ReduceSum(p.tiny, p.scores, p.work, static_cast<int32_t>(n));
        AscendC::PipeBarrier<PIPE_V>();
        AscendC::Ln(p.tiny[8], p.tiny, 1);
        AscendC::SetFlag<AscendC::HardEvent::V_S>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::V_S>(EVENT_ID0);
        const float sum = p.tiny.GetValue(0);
        const float lse = top + p.tiny.GetValue(8);
        // o = (sum_j p_j v_j) / l, in key order.
        AscendC::LocalTensor<acc_t> record = p.stage[static_cast<uint32_t>(i * s.pr)];
        if (s.dv > 0) {
            AscendC::Muls(record, p.vf, p.scores.GetValue(0), static_cast<int32_t>(s.dv));
            AscendC::PipeBarrier<PIPE_V>();
            for (int64_t j = 1; j < n; ++j) {
                AscendC::Axpy(record, p.vf[static_cast<uint32_t>(j * s.pv)], p.scores.GetValue(static_cast<uint32_t>(j)),
                              static_cast<int32_t>(s.dv));
                AscendC::PipeBarrier<PIPE_V>();
            }
            AscendC::Muls(record, record, 1.0f / sum, static_cast<int32_t>(s.dv));
            AscendC::PipeBarrier<PIPE_V>();
        }
        record.SetValue(static_cast<uint32_t>(s.dv), lse);
    }
}

// Row t = (b, h) of the output and its log-sum-exp from every source's records (`records`, this
// rank's receive buffer, complete), in rank order and chunk order.
__aicore__ inline void combine_row(Phase2 &p, const Dims &s, __gm__ acc_t *records, __gm__ int64_t *chunks,
                                   __gm__ int64_t *offsets, int64_t t, __gm__ elem_t *out_rows, __gm__ acc_t *lse_rows) {
    const int64_t b = t / s.heads, h = t % s.heads, record = s.dv + 1;
    float top = NEG_INF, sum = 0.0f;
    bool any = false;
    for (int64_t src = 0; src < s.world; ++src) {
        const int64_t cs = chunks[src];
        for (int64_t c0 = 0; c0 < cs; c0 += s.record_rows) {
            const int64_t rows = valid_len(c0, s.record_rows, cs);
            // The last records' vector work is done with the buffer.
            AscendC::SetFlag<AscendC::HardEvent::V_MTE2>(EVENT_ID0);
            AscendC::WaitFlag<AscendC::HardEvent::V_MTE2>(EVENT_ID0);
            __gm__ acc_t *first = records + offsets[src] + ((b * cs + c0) * s.heads + h) * record;
            load_2d(p.recs, first, s.heads * record, rows, record);
            AscendC::SetFlag<AscendC::HardEvent::MTE2_S>(EVENT_ID0);
            AscendC::WaitFlag<AscendC::HardEvent::MTE2_S>(EVENT_ID0);
            AscendC::SetFlag<AscendC::HardEvent::MTE2_V>(EVENT_ID0);
            AscendC::WaitFlag<AscendC::HardEvent::MTE2_V>(EVENT_ID0);
            for (int64_t i = 0; i < rows; ++i) {
                AscendC::LocalTensor<acc_t> rec = p.recs[static_cast<uint32_t>(i * s.pr)];
                const float part = rec.GetValue(static_cast<uint32_t>(s.dv));
                if (part == NEG_INF) {
                    continue;  // no keys
                }
                // top' = max(top, part); sum = sum * exp(top - top') + exp(part - top'); the same
                // weights for the outputs.
                const float next = part > top ? part : top;
                p.tiny.SetValue(0, any ? top - next : 0.0f);
                p.tiny.SetValue(1, part - next);
                AscendC::SetFlag<AscendC::HardEvent::S_V>(EVENT_ID0);
                AscendC::WaitFlag<AscendC::HardEvent::S_V>(EVENT_ID0);
                AscendC::Exp(p.tiny, p.tiny, 2);
                AscendC::SetFlag<AscendC::HardEvent::V_S>(EVENT_ID0);
                AscendC::WaitFlag<AscendC::HardEvent::V_S>(EVENT_ID0);
                const float old = any ? p.tiny.GetValue(0) : 0.0f;
                const float now = p.tiny.GetValue(1);
                sum = sum * old + now;
                if (s.dv > 0) {
                    if (any) {
                        AscendC::Muls(p.acc, p.acc, old, static_cast<int32_t>(s.dv));
                        AscendC::PipeBarrier<PIPE_V>();
                        AscendC::Axpy(p.acc, rec, now, static_cast<int32_t>(s.dv));
                    } else {
                        AscendC::Muls(p.acc, rec, now, static_cast<int32_t>(s.dv));
                    }
                    AscendC::PipeBarrier<PIPE_V>();
                }
                top = next;
                any = true;
            }
        }
    }
    float lse = NEG_INF;
    if (any) {
        if (s.dv > 0) {
            AscendC::Muls(p.acc, p.acc, 1.0f / sum, static_cast<int32_t>(s.dv));
            AscendC::PipeBarrier<PIPE_V>();
        }
        p.tiny.SetValue(0, sum);
        AscendC::SetFlag<AscendC::HardEvent::S_V>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::S_V>(EVENT_ID0);
        AscendC::Ln(p.tiny[8], p.tiny, 1);
        AscendC::SetFlag<AscendC::HardEvent::V_S>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::V_S>(EVENT_ID0);
        lse = top + p.tiny.GetValue(8);
    } else {
        // No keys on any rank: zeros.
        for (int64_t j = 0; j < s.dv; ++j) {
            p.acc.SetValue(static_cast<uint32_t>(j), 0.0f);
        }
        AscendC::SetFlag<AscendC::HardEvent::S_V>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::S_V>(EVENT_ID0);
        AscendC::SetFlag<AscendC::HardEvent::S_MTE3>(EVENT_ID0);
        AscendC::WaitFlag<AscendC::HardEvent::S_MTE3>(EVENT_ID0);
    }
    if (s.dv > 0) {
        round_store(out_rows + t * s.dv, s.dv, p.acc, p.oraw, 1, s.dv);
        AscendC::SetFlag<AscendC::HardEvent::MTE3_V>(EVENT_ID0);  // the next row's sums overwrite acc
        AscendC::WaitFlag<AscendC::HardEvent::MTE3_V>(EVENT_ID0);
    }
    p.lse_slot.SetValue(0, lse);
    AscendC::SetFlag<AscendC::HardEvent::S_MTE3>(EVENT_ID0);
    AscendC::WaitFlag<AscendC::HardEvent::S_MTE3>(EVENT_ID0);
    store_2d(lse_rows + t, 1, p.lse_slot, 1, 1);
    AscendC::SetFlag<AscendC::HardEvent::MTE3_S>(EVENT_ID0);  // the next row's scalar writes
    AscendC::WaitFlag<AscendC::HardEvent::MTE3_S>(EVENT_ID0);
}

extern "C" __global__ __aicore__ void flash_decode(
    GM_ADDR q,         // [batch, heads, d] elem_t, the same on every rank
    GM_ADDR k,         // [batch, keys, kv_heads, d] elem_t: this rank's keys
    GM_ADDR v,         // [batch, keys, kv_heads, dv] elem_t: this rank's values
    GM_ADDR out,       // [batch, heads, dv] elem_t
    GM_ADDR lse,       // [batch, heads] f32
    GM_ADDR recv,      // symmetric f32: every source's records, source-major; within source r,
                       // record ((b * chunks[r] + c) * heads + h) * (dv + 1)
    GM_ADDR arrived,   // symmetric int32 [num_ranks]: tasks of each source landed here
    GM_ADDR table,     // int64: chunks[w] (chunks of each rank's keys), offsets[w+1] (where each
                       // source's records start in recv), expected[w] (by source, cumulative)
    GM_ADDR status,    // int64 [8]: what a wait that timed out saw
    int64_t rank, int64_t num_ranks, int64_t batch, int64_t heads, int64_t kv_heads, int64_t d,
    int64_t dv,
    int64_t keys,         // this rank's keys
    int64_t chunk,        // keys per first-phase task (the host's cut)
    int64_t record_rows,  // records the combine loads at once (the host's cut)
    int64_t scale_bits,   // the scale, as the bits of an f32
    int64_t timeout_cycles)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    const int64_t me = rank, world = num_ranks;
    const int64_t pid = program_id_vec(), ncore = num_programs();
    __gm__ int64_t *tab = reinterpret_cast<__gm__ int64_t *>(table);
    __gm__ int64_t *chunks = tab;
    __gm__ int64_t *offsets = tab + world;
    __gm__ int64_t *expected = tab + 2 * world + 1;
    __gm__ elem_t *q_in = reinterpret_cast<__gm__ elem_t *>(q);
    __gm__ elem_t *k_in = reinterpret_cast<__gm__ elem_t *>(k);
    __gm__ elem_t *v_in = reinterpret_cast<__gm__ elem_t *>(v);
    __gm__ elem_t *out_rows = reinterpret_cast<__gm__ elem_t *>(out);
    __gm__ acc_t *lse_rows = reinterpret_cast<__gm__ acc_t *>(lse);
    __gm__ acc_t *recv_buf = reinterpret_cast<__gm__ acc_t *>(recv);
    __gm__ int32_t *signals = reinterpret_cast<__gm__ int32_t *>(arrived);
    const Status st{reinterpret_cast<__gm__ int64_t *>(status), timeout_cycles};
    const float scale = float_from_bits(scale_bits);
    const int64_t group = kv_heads == 0 ? 0 : heads / kv_heads;
    const Dims s{world, batch, heads, kv_heads, group, d, dv, keys, chunk, record_rows,
                 ub_pitch<elem_t>(d), ub_pitch<elem_t>(dv), ub_pitch<acc_t>(dv + 1)};
    AscendC::TPipe pipe;
    AscendC::TBuf<AscendC::TPosition::VECCALC> ub_buf;
    pipe.InitBuffer(ub_buf, UB_DECODE_BYTES);
    AscendC::LocalTensor<uint8_t> ub = ub_buf.Get<uint8_t>();

    // ---- phase 1: tasks (b, chunk of this rank's keys); records to every rank, rotated ----
    Phase1 p1 = carve_phase1(ub, s);
    const int64_t mine = chunks[me], tasks = batch * mine;
    int64_t done = 0;
    for (int64_t t = pid; t < tasks; t += ncore) {
        const int64_t b = t / mine, c = t % mine;
        const int64_t key0 = c * chunk;
        const int64_t n = valid_len(key0, chunk, keys);  // the last chunk is ragged: a mask
        for (int64_t g = 0; g < kv_heads && group > 0; ++g) {
            __gm__ elem_t *q_rows = q_in + (b * heads + g * group) * d;
            __gm__ elem_t *k_rows = k_in + ((b * keys + key0) * kv_heads + g) * d;
            __gm__ elem_t *v_rows = v_in + ((b * keys + key0) * kv_heads + g) * dv;
            group_records(p1, s, q_rows, k_rows, v_rows, n, scale);
            // The group's records, side by side, into every rank's receive buffer.
            AscendC::SetFlag<AscendC::HardEvent::V_MTE3>(EVENT_ID0);
            AscendC::WaitFlag<AscendC::HardEvent::V_MTE3>(EVENT_ID0);
            AscendC::SetFlag<AscendC::HardEvent::S_MTE3>(EVENT_ID0);
            AscendC::WaitFlag<AscendC::HardEvent::S_MTE3>(EVENT_ID0);
            const int64_t at = offsets[me] + ((b * mine + c) * heads + g * group) * (dv + 1);
            for (int64_t i = 0; i < world; ++i) {
                const int64_t dst = (me + i) % world;
                store_2d(symm_at(recv_buf, dst) + at, dv + 1, p1.stage, group, dv + 1);
            }
            // The next group's vector and scalar writes come after the stores have read.
            AscendC::SetFlag<AscendC::HardEvent::MTE3_V>(EVENT_ID0);
            AscendC::WaitFlag<AscendC::HardEvent::MTE3_V>(EVENT_ID0);
            AscendC::SetFlag<AscendC::HardEvent::MTE3_S>(EVENT_ID0);
            AscendC::WaitFlag<AscendC::HardEvent::MTE3_S>(EVENT_ID0);
        }
        ++done;
    }
    if (done > 0) {
        for (int64_t i = 0; i < world; ++i) {
            notify_add(signals, me, (me + i) % world, static_cast<int32_t>(done));
        }
    }
    AscendC::PipeBarrier<PIPE_ALL>();  // the second phase reuses the unified buffer

    // ---- phase 2: tasks (b, h), once every source's records are here ----------------------
    Phase2 p2 = carve_phase2(ub, s);
    const int64_t rows = batch * heads;
    bool waited = false;
    Token token{true};
    for (int64_t t = pid; t < rows; t += ncore) {
        if (!waited) {
            for (int64_t src = 0; src < world; ++src) {
                if (chunks[src] > 0) {
                    token = wait_ge(signals, src, static_cast<int32_t>(expected[src]), st, pid, 0);
                    if (!token.ok) {
                        return;  // the host reads the status record and reports the timeout
                    }
                }
            }
            waited = true;
        }
        combine_row(p2, s, consume_token(recv_buf, token), chunks, offsets, t, out_rows, lse_rows);
    }
}
