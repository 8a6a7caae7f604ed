/*
 * TEST STAND-IN FOR CANN'S OPERATOR LIBRARY (libopapi.so: aclTensor descriptors and the aclnn
 * operators the crate calls). NOT AN OPERATOR LIBRARY: NOTHING IS COMPUTED.
 *
 * Used only by dist-tensor's tests/ascend_*.rs, built beside the AscendCL stand-in, to check
 * the two-phase calls (get the workspace size, then execute) of aclnnMatmul and of the MC2
 * fused operators aclnnAllGatherMatmul / aclnnMatmulReduceScatter, with the arguments the
 * crate passes. The first phase checks what CANN's documentation says the operators take
 * (two-dimensional ND tensors of matching types, f16/bf16 and K in [256, 65535) for MC2, gather
 * index 0, comm turn 0, stream mode 1, reduce op "sum") and refuses the rest with
 * ACLNN_ERR_PARAM_INVALID and a message for aclGetRecentErrMsg; the second phase records the
 * run. Every call is recorded in the AscendCL stand-in's log (found with dlsym) and fails as it
 * was told to (standin_fail).
 */

#include "stand_in_log.h"
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ACLNN_SUCCESS 0
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002
#define ACL_FLOAT 0
#define ACL_FLOAT16 1
#define ACL_BF16 27
#define ACL_FORMAT_ND 2

struct tensor {
    char magic[8];
    int64_t dims[8];
    uint64_t rank;
    int dtype;
    void *data;
};

struct executor {
    char op[48];
    uint64_t workspace;
};

static int refuse(const char *message) {
    void (*set)(const char *) = (void (*)(const char *))dlsym(RTLD_DEFAULT, "standin_set_recent");
    if (set != NULL) set(message);
    return ACLNN_ERR_PARAM_INVALID;
}

static const struct tensor *as_tensor(const void *handle) {
    const struct tensor *t = handle;
    return t != NULL && memcmp(t->magic, "STANDIN", 8) == 0 ? t : NULL;
}

void *aclCreateTensor(const int64_t *view_dims, uint64_t view_rank, int data_type, const int64_t *strides,
                      int64_t offset, int format, const int64_t *storage_dims, uint64_t storage_rank, void *data) {
    (void)strides;
    (void)storage_dims;
    if (view_rank == 0 || view_rank > 8 || format != ACL_FORMAT_ND || offset != 0 || storage_rank != view_rank ||
        data == NULL) {
        record("aclCreateTensor(refused)");
        return NULL;
    }
    struct tensor *t = calloc(1, sizeof *t);
    memcpy(t->magic, "STANDIN", 8);
    memcpy(t->dims, view_dims, view_rank * sizeof(int64_t));
    t->rank = view_rank;
    t->dtype = data_type;
    t->data = data;
    if (view_rank == 2) {
        record("aclCreateTensor([%lld,%lld],type=%d)", (long long)view_dims[0], (long long)view_dims[1], data_type);
    } else {
        record("aclCreateTensor(rank %llu,type=%d)", (unsigned long long)view_rank, data_type);
    }
    return t;
}

int aclDestroyTensor(const void *handle) {
    struct tensor *t = (struct tensor *)as_tensor(handle);
    if (t == NULL) return ACLNN_ERR_PARAM_NULLPTR;
    memset(t->magic, 0, sizeof t->magic);
    free(t);
    return ACLNN_SUCCESS;
}

static int make_executor(const char *op, uint64_t workspace, uint64_t *size, void **executor) {
    struct executor *e = calloc(1, sizeof *e);
    snprintf(e->op, sizeof e->op, "%s", op);
    e->workspace = workspace;
    *size = workspace;
    *executor = e;
    return ACLNN_SUCCESS;
}

/* Checks a product's operands: 2-D, matching types and inner dimensions. */
static int check_product(const struct tensor *a, const struct tensor *b, const struct tensor *out) {
    if (a == NULL || b == NULL || out == NULL) return ACLNN_ERR_PARAM_NULLPTR;
    if (a->rank != 2 || b->rank != 2 || out->rank != 2) return refuse("EZ1001: operands must be 2-D (stand-in)");
    if (a->dtype != b->dtype || a->dtype != out->dtype) return refuse("EZ1002: operand types differ (stand-in)");
    if (a->dims[1] != b->dims[0]) return refuse("EZ1003: inner dimensions differ (stand-in)");
    return ACLNN_SUCCESS;
}

static int check_mc2(const struct tensor *a) {
    if (a->dtype != ACL_FLOAT16 && a->dtype != ACL_BF16) return refuse("EZ1004: MC2 takes float16 or bfloat16 (stand-in)");
    if (a->dims[1] < 256 || a->dims[1] >= 65535) return refuse("EZ1005: the k-axis should be in range[256, 65535) (stand-in)");
    return ACLNN_SUCCESS;
}

/* What an MC2 op's GetWorkspaceSize `call` answers before its own attributes: the injected
 * failure, the product's operands, its other arguments (`named`: none is NULL), then MC2's rules. */
static int mc2_call(const char *call, const struct tensor *a, const struct tensor *b, const struct tensor *out,
                    int named) {
    int status = injected(call);
    if (status != 0) return status;
    status = check_product(a, b, out);
    if (status != ACLNN_SUCCESS) return status;
    if (!named) return ACLNN_ERR_PARAM_NULLPTR;
    return check_mc2(a);
}

int aclnnMatmulGetWorkspaceSize(const void *self, const void *mat2, void *out, int8_t cube_math_type,
                                uint64_t *workspace_size, void **executor) {
    const struct tensor *a = as_tensor(self), *b = as_tensor(mat2), *c = as_tensor(out);
    record("aclnnMatmulGetWorkspaceSize(cubeMathType=%d)", cube_math_type);
    int status = injected("aclnnMatmulGetWorkspaceSize");
    if (status != 0) return status;
    status = check_product(a, b, c);
    if (status != ACLNN_SUCCESS) return status;
    if (c->dims[0] != a->dims[0] || c->dims[1] != b->dims[1]) return refuse("EZ1006: output shape (stand-in)");
    return make_executor("aclnnMatmul", 256, workspace_size, executor);
}

int aclnnAllGatherMatmulGetWorkspaceSize(const void *x1, const void *x2, const void *bias, const char *group,
                                         int64_t gather_index, int64_t comm_turn, int64_t stream_mode,
                                         const void *output, const void *gather_out, uint64_t *workspace_size,
                                         void **executor) {
    const struct tensor *a = as_tensor(x1), *b = as_tensor(x2), *c = as_tensor(output), *g = as_tensor(gather_out);
    record("aclnnAllGatherMatmulGetWorkspaceSize(group=%s,gatherIndex=%lld,commTurn=%lld,streamMode=%lld,bias=%s)",
           group == NULL ? "NULL" : group, (long long)gather_index, (long long)comm_turn, (long long)stream_mode,
           bias == NULL ? "none" : "some");
    int status = mc2_call("aclnnAllGatherMatmulGetWorkspaceSize", a, b, c, g != NULL && group != NULL);
    if (status != ACLNN_SUCCESS) return status;
    if (gather_index != 0 || comm_turn != 0 || stream_mode != 1) return refuse("EZ1007: attributes (stand-in)");
    return make_executor("aclnnAllGatherMatmul", 1024, workspace_size, executor);
}

int aclnnMatmulReduceScatterGetWorkspaceSize(const void *x1, const void *x2, const void *bias, const char *group,
                                             const char *reduce_op, int64_t comm_turn, int64_t stream_mode,
                                             const void *output, uint64_t *workspace_size, void **executor) {
    const struct tensor *a = as_tensor(x1), *b = as_tensor(x2), *c = as_tensor(output);
    record("aclnnMatmulReduceScatterGetWorkspaceSize(group=%s,reduceOp=%s,commTurn=%lld,streamMode=%lld,bias=%s)",
           group == NULL ? "NULL" : group, reduce_op == NULL ? "NULL" : reduce_op, (long long)comm_turn,
           (long long)stream_mode, bias == NULL ? "none" : "some");
    int status = mc2_call("aclnnMatmulReduceScatterGetWorkspaceSize", a, b, c, group != NULL && reduce_op != NULL);
    if (status != ACLNN_SUCCESS) return status;
    if (strcmp(reduce_op, "sum") != 0 || comm_turn != 0 || stream_mode != 1) return refuse("EZ1008: attributes (stand-in)");
    return make_executor("aclnnMatmulReduceScatter", 1024, workspace_size, executor);
}

static int execute(const char *op, void *workspace, uint64_t workspace_size, void *executor, void *stream) {
    struct executor *e = executor;
    record("%s(workspace=%llu)", op, (unsigned long long)workspace_size);
    (void)stream;
    int status = injected(op);
    if (status != 0) return status;
    if (e == NULL || strcmp(e->op, op) != 0) return refuse("EZ1009: not this operator's executor (stand-in)");
    if (workspace_size < e->workspace || (e->workspace > 0 && workspace == NULL)) return refuse("EZ1010: workspace too small (stand-in)");
    free(e);
    return ACLNN_SUCCESS;
}

int aclnnMatmul(void *workspace, uint64_t size, void *executor, void *stream) {
    return execute("aclnnMatmul", workspace, size, executor, stream);
}

int aclnnAllGatherMatmul(void *workspace, uint64_t size, void *executor, void *stream) {
    return execute("aclnnAllGatherMatmul", workspace, size, executor, stream);
}

int aclnnMatmulReduceScatter(void *workspace, uint64_t size, void *executor, void *stream) {
    return execute("aclnnMatmulReduceScatter", workspace, size, executor, stream);
}
