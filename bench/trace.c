/*
 * A timeline of what a CUDA program ran, for the GPU machine, which has no Nsight Systems:
 * loaded into any program through the driver's injection hook, it records with CUPTI every
 * kernel, copy and memset (GPU start/end, stream) and every CUDA runtime and driver call (host
 * start/end; libraries such as cuBLAS launch through the driver) and writes them as CSV when
 * the program exits. bench/trace_summary.py reads the CSV.
 *
 *   CUDA_INJECTION64_PATH=build/bench/libmoe_trace.so MOE_TRACE_OUT=trace.csv \
 *       build/bench/bench_moe profile 0
 *
 * Unlike ncu, kernels run as they do in the program (concurrently, caches warm), so the CSV
 * shows the gaps between them and the host calls that caused them.
 * Columns: kind (kernel, memcpy, memset, api: runtime call, drv: driver call), name, start_ns,
 * end_ns, stream (-1 for calls), correlation id (a call and the work it launched share one).
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include <cupti.h>

#define BUFFER_BYTES (8u << 20)

static FILE *trace_out;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
    /* CUPTI wants 8-byte aligned buffers */
    *buffer = aligned_alloc(8, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static const char *api_name(CUpti_CallbackDomain domain, uint32_t cbid)
{
    const char *name = NULL;
    if (cuptiGetCallbackName(domain, cbid, &name) != CUPTI_SUCCESS || !name) return "unknown";
    return name;
}

static void write_record(const CUpti_Activity *r)
{
    switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL: {
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
        /* kernel names hold commas (template arguments): quote them */
        fprintf(trace_out, "kernel,\"%s\",%llu,%llu,%u,%u\n", k->name, (unsigned long long)k->start,
                (unsigned long long)k->end, k->streamId, k->correlationId);
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
        fprintf(trace_out, "memcpy,kind%u_%llu_bytes,%llu,%llu,%u,%u\n", (unsigned)m->copyKind,
                (unsigned long long)m->bytes, (unsigned long long)m->start,
                (unsigned long long)m->end, m->streamId, m->correlationId);
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
        const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
        fprintf(trace_out, "memset,%llu_bytes,%llu,%llu,%u,%u\n", (unsigned long long)m->bytes,
                (unsigned long long)m->start, (unsigned long long)m->end, m->streamId,
                m->correlationId);
        break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
        const CUpti_ActivityAPI *a = (const CUpti_ActivityAPI *)r;
        bool runtime = r->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
        CUpti_CallbackDomain domain = runtime ? CUPTI_CB_DOMAIN_RUNTIME_API
                                              : CUPTI_CB_DOMAIN_DRIVER_API;
        fprintf(trace_out, "%s,%s,%llu,%llu,-1,%u\n", runtime ? "api" : "drv",
                api_name(domain, a->cbid), (unsigned long long)a->start, (unsigned long long)a->end,
                a->correlationId);
        break;
    }
    default: break;
    }
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid)
{
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *r = NULL;
    while (trace_out && cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS)
        write_record(r);
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
        fprintf(stderr, "moe_trace: %zu records dropped\n", dropped);
    free(buffer);
}

static void finish(void)
{
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (trace_out) fclose(trace_out);
    trace_out = NULL;
}

/* Called by the CUDA driver when CUDA_INJECTION64_PATH names this library. */
int InitializeInjection(void)
{
    const char *path = getenv("MOE_TRACE_OUT");
    trace_out = fopen(path ? path : "trace.csv", "w");
    if (!trace_out) {
        perror("moe_trace: MOE_TRACE_OUT");
        return 0;
    }
    fprintf(trace_out, "kind,name,start_ns,end_ns,stream,correlation\n");
    const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                        CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
                                        CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) {
        fprintf(stderr, "moe_trace: cuptiActivityRegisterCallbacks failed\n");
        return 0;
    }
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (cuptiActivityEnable(kinds[i]) != CUPTI_SUCCESS)
            fprintf(stderr, "moe_trace: activity kind %d not enabled\n", (int)kinds[i]);
    atexit(finish);
    return 1;
}
