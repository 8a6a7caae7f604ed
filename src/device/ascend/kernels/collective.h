// What the collectives' Ascend C kernels share, the twin of src/collectives/workspace.rs:
// publish (a rank copies its input into its own symmetric staging buffer, then every program
// adds one to a `ready` signal of every peer, rotated), and source (a rank reads a peer's
// staging through symm_at once every program of that peer has published: the peer's count
// reaches the cumulative value the host computed). No signal is ever reset; a rank rewrites its
// staging only in its next call, after the host's shape exchange, when every peer has finished
// this one. Vector-only kernels: one program per vector core.
#pragma once

#include "prelude.h"

namespace dt {

// The publish step, run by every program: its chunks of `input` (`rows` x `row_len`, cut as
// the host's TilePlan cuts them) into this rank's staging at the same place, then one notify to
// every peer, rotated.
__aicore__ inline void publish_part(__gm__ elem_t *staging, __gm__ elem_t *input, int64_t rows, int64_t row_len,
                                    int64_t row_step, int64_t col_step, __gm__ int32_t *ready, int64_t me,
                                    int64_t world, AscendC::LocalTensor<elem_t> &ub) {
    const int64_t pid = program_id_vec(), ncore = num_programs();
    const int64_t count = chunk_count(rows, row_len, row_step, col_step);
    for (int64_t t = pid; t < count; t += ncore) {
        const Chunk c = chunk_at(t, rows, row_len, row_step, col_step);
        const int64_t at = c.row * row_len + c.col;
        copy_2d(staging + at, row_len, input + at, row_len, c.rows, c.cols, ub);
    }
    for (int64_t i = 1; i < world; ++i) {
        notify_add(ready, me, (me + i) % world, 1);
    }
}

// Where to read rank `src`'s published input: this rank's own `input`, or, once all of `src`'s
// programs have published, its staging buffer through symm_at. Null when the wait timed out.
__aicore__ inline __gm__ elem_t *source(__gm__ elem_t *staging, __gm__ elem_t *input, int64_t src, int64_t me,
                                        __gm__ int32_t *ready, int64_t ready_at, Status st) {
    if (src == me) {
        return input;
    }
    const Token token = wait_ge(ready, src, static_cast<int32_t>(ready_at), st, program_id_vec(), 0);
    if (!token.ok) {
        return nullptr;
    }
    return consume_token(symm_at(staging, src), token);
}

}  // namespace dt
