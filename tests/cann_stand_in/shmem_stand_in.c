/*
 * TEST STAND-IN FOR ASCEND SHMEM (libshmem.so, the aclshmem_* host calls). NOT SHMEM: NO
 * DEVICE, NO BOOTSTRAP, NO REMOTE MEMORY.
 *
 * Used only by dist-tensor's tests/ascend_*.rs, built beside the AscendCL stand-in, to check
 * how the crate initialises SHMEM and uses its symmetric heap on machines without CANN.
 *
 * A PE is identified by the calling thread's current device (the AscendCL stand-in's
 * aclrtGetDevice): aclshmemx_init_attr makes the current device PE `my_pe`, with a heap of
 * `local_mem_size` bytes of host memory; aclshmem_malloc takes the same offset on every PE
 * (a bump allocator; freeing the newest allocation gives its space back); aclshmem_ptr(ptr, pe)
 * is PE `pe`'s heap base plus ptr's offset in the caller's heap.
 *
 * THAT IS THE MODEL World::ascend ASSUMES (one PE per device, the devices being threads of one
 * process). Ascend SHMEM's documentation describes a PE as a process, and whether the real
 * library accepts several PEs in one process is NOT KNOWN. The control
 *   standin_shmem_process_global(1)
 * makes this stand-in keep one PE for the whole process (the last initialised wins), as a
 * library with process-wide state would, so that the tests check the crate notices. Setting it
 * (either way) also forgets every PE: a fresh start for the next test.
 *
 * Every PE's heap is announced to the AscendCL stand-in (standin_register_heap, when it has it:
 * the executing build), whose kernel launches reach every heap through it.
 *
 * aclshmemx_init_attr also checks the attribute struct's layout (the optional attributes'
 * version word), and every call is recorded in the AscendCL stand-in's log.
 */

#include "stand_in_log.h"
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PES 64
#define ACLSHMEM_INVALID_PARAM (-1)
#define ACLSHMEM_NOT_INITED (-5)
#define INIT_WITH_UNIQUEID (1u << 3)

typedef struct {
    int32_t version;
    int my_pe;
    int n_pes;
    char internal[124];
} uniqueid_t;

typedef struct {
    int version;
    int data_op_engine_type;
    uint32_t shm_init_timeout;
    uint32_t shm_create_timeout;
    uint32_t control_operation_timeout;
    int32_t sock_fd;
} optional_attr_t;

typedef struct {
    int my_pe;
    int n_pes;
    char ip_port[64];
    uint64_t local_mem_size;
    optional_attr_t option_attr;
    void *comm_args;
    uint64_t instance_id;
} init_attr_t;

struct pe {
    int device; /* -1: free slot */
    int n_pes;
    unsigned char *heap;
    size_t size;
    size_t used;
    size_t last; /* offset of the newest allocation */
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static void announce(int pe, int device, void *base, size_t size);
static struct pe g_pes[MAX_PES];
static int g_process_global;
static int g_global_pe = -1;

__attribute__((constructor)) static void on_load(void) {
    for (int i = 0; i < MAX_PES; i++) g_pes[i].device = -1;
}

void standin_shmem_process_global(int on) {
    pthread_mutex_lock(&g_lock);
    g_process_global = on;
    for (int i = 0; i < MAX_PES; i++) { /* a fresh start: no PE */
        if (g_pes[i].heap != NULL) announce(i, -1, NULL, 0);
        free(g_pes[i].heap);
        g_pes[i].heap = NULL;
        g_pes[i].device = -1;
    }
    g_global_pe = -1;
    pthread_mutex_unlock(&g_lock);
}

/* Tells the executing AscendCL stand-in where PE `pe`'s heap is (size 0: gone). */
static void announce(int pe, int device, void *base, size_t size) {
    void (*reg)(int, int, void *, size_t) = (void (*)(int, int, void *, size_t))dlsym(RTLD_DEFAULT, "standin_register_heap");
    if (reg != NULL) reg(pe, device, base, size);
}

static int current_device(void) {
    int (*get)(int32_t *) = (int (*)(int32_t *))dlsym(RTLD_DEFAULT, "aclrtGetDevice");
    int32_t device = -1;
    if (get == NULL || get(&device) != 0) return -1;
    return device;
}

/* The calling PE (the caller holds g_lock); -1 when not initialised. */
static int my_pe_locked(void) {
    if (g_process_global) return g_global_pe;
    int device = current_device();
    for (int i = 0; i < MAX_PES; i++) {
        if (g_pes[i].device >= 0 && g_pes[i].device == device) return i;
    }
    return -1;
}

int aclshmemx_get_uniqueid(uniqueid_t *uid) {
    record("aclshmemx_get_uniqueid(dev=%d)", current_device());
    int status = injected("aclshmemx_get_uniqueid");
    if (status != 0) return status;
    if (uid == NULL || uid->version != (1 << 16) + (int32_t)sizeof(uniqueid_t)) return ACLSHMEM_INVALID_PARAM;
    memset(uid->internal, 0, sizeof uid->internal);
    snprintf(uid->internal, sizeof uid->internal, "dist-tensor shmem stand-in uid");
    return 0;
}

int aclshmemx_set_attr_uniqueid_args(int my_pe, int n_pes, int64_t local_mem_size, uniqueid_t *uid,
                                     init_attr_t *attr) {
    record("aclshmemx_set_attr_uniqueid_args(pe=%d,n=%d,%lld bytes)", my_pe, n_pes, (long long)local_mem_size);
    if (uid == NULL || attr == NULL || strcmp(uid->internal, "dist-tensor shmem stand-in uid") != 0) {
        return ACLSHMEM_INVALID_PARAM;
    }
    if (my_pe < 0 || my_pe >= n_pes || n_pes > MAX_PES || local_mem_size <= 0) return ACLSHMEM_INVALID_PARAM;
    attr->my_pe = my_pe;
    attr->n_pes = n_pes;
    attr->local_mem_size = (uint64_t)local_mem_size;
    attr->comm_args = uid;
    return 0;
}

int aclshmemx_init_attr(unsigned int flags, init_attr_t *attr) {
    int device = current_device();
    record("aclshmemx_init_attr(dev=%d,pe=%d,n=%d,%llu bytes)", device, attr == NULL ? -1 : attr->my_pe,
           attr == NULL ? -1 : attr->n_pes, attr == NULL ? 0ULL : (unsigned long long)attr->local_mem_size);
    int status = injected("aclshmemx_init_attr");
    if (status != 0) return status;
    if (flags != INIT_WITH_UNIQUEID || attr == NULL || attr->comm_args == NULL || device < 0) return ACLSHMEM_INVALID_PARAM;
    if (attr->option_attr.version != (1 << 16) + (int)sizeof(optional_attr_t)) return ACLSHMEM_INVALID_PARAM;
    pthread_mutex_lock(&g_lock);
    struct pe *pe = &g_pes[attr->my_pe];
    if (pe->device >= 0 && !g_process_global) {
        pthread_mutex_unlock(&g_lock);
        return ACLSHMEM_INVALID_PARAM; /* already a PE */
    }
    pe->device = device;
    pe->n_pes = attr->n_pes;
    pe->size = attr->local_mem_size;
    pe->heap = calloc(1, pe->size);
    pe->used = 0;
    pe->last = 0;
    g_global_pe = attr->my_pe;
    announce(attr->my_pe, device, pe->heap, pe->size);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

int aclshmem_my_pe(void) {
    pthread_mutex_lock(&g_lock);
    int pe = my_pe_locked();
    pthread_mutex_unlock(&g_lock);
    return pe;
}

int aclshmem_n_pes(void) {
    pthread_mutex_lock(&g_lock);
    int pe = my_pe_locked();
    int n = pe < 0 ? -1 : g_pes[pe].n_pes;
    pthread_mutex_unlock(&g_lock);
    return n;
}

void *aclshmem_malloc(size_t size) {
    pthread_mutex_lock(&g_lock);
    int me = my_pe_locked();
    void *ptr = NULL;
    size_t at = 0;
    if (me >= 0) {
        struct pe *pe = &g_pes[me];
        at = (pe->used + 511) / 512 * 512;
        if (at + size <= pe->size) {
            ptr = pe->heap + at;
            pe->last = at;
            pe->used = at + size;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (ptr != NULL && injected("aclshmem_malloc") != 0) ptr = NULL;
    record("aclshmem_malloc(pe=%d,%zu)->%s%zu", me, size, ptr == NULL ? "null:" : "", at);
    return ptr;
}

void aclshmem_free(void *ptr) {
    pthread_mutex_lock(&g_lock);
    int me = my_pe_locked();
    size_t at = 0;
    if (me >= 0 && ptr != NULL) {
        struct pe *pe = &g_pes[me];
        at = (size_t)((unsigned char *)ptr - pe->heap);
        if (at == pe->last) pe->used = at; /* the newest allocation: its space is free again */
    }
    pthread_mutex_unlock(&g_lock);
    record("aclshmem_free(pe=%d,%zu)", me, at);
}

void *aclshmem_ptr(void *ptr, int pe_index) {
    pthread_mutex_lock(&g_lock);
    int me = my_pe_locked();
    void *peer = NULL;
    if (me >= 0 && pe_index >= 0 && pe_index < g_pes[me].n_pes && g_pes[pe_index].heap != NULL) {
        size_t at = (size_t)((unsigned char *)ptr - g_pes[me].heap);
        if (at < g_pes[me].size) peer = g_pes[pe_index].heap + at;
    }
    pthread_mutex_unlock(&g_lock);
    record("aclshmem_ptr(pe=%d,to=%d)->%s", me, pe_index, peer == NULL ? "null" : "ok");
    return peer;
}

int aclshmem_finalize(void) {
    pthread_mutex_lock(&g_lock);
    int me = my_pe_locked();
    if (me >= 0) {
        announce(me, -1, NULL, 0);
        free(g_pes[me].heap);
        g_pes[me].heap = NULL;
        g_pes[me].device = -1;
    }
    if (g_process_global) g_global_pe = -1;
    pthread_mutex_unlock(&g_lock);
    record("aclshmem_finalize(pe=%d)", me);
    return me >= 0 ? 0 : ACLSHMEM_NOT_INITED;
}
