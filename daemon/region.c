/* Shared regions of one connection (daemon/region.h). */
#include "daemon/region.h"

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"
#include "daemon/log.h"

struct epd_region {
    uint32_t id;
    epd_region_kind_t kind;
    uint64_t bytes;
    uint8_t *base;     /* the region's first byte (host mapping, or device pointer) */
    void *map;         /* host: the mapping; cuda: the opened allocation */
    size_t map_len;
    bool page_locked;  /* host: registered with the ops (cudaHostRegister) */
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    atomic_uint refs;  /* the table's (until unregistered) and one per request using it */
};

struct epd_region_table {
    uint32_t max_regions;
    uint32_t next_id; /* ids are never reused within a connection */
    const epd_ops_t *ops;
    epd_ops_ctx_t *ops_ctx;
    epd_region_t **slots; /* [max_regions] */
    uint64_t fetch_ns;    /* time in the device fetch since the last take (EPD_TRACE) */
};

epd_region_table_t *epd_region_table_create(uint32_t max_regions, const epd_ops_t *ops,
                                            epd_ops_ctx_t *ops_ctx)
{
    epd_region_table_t *table = calloc(1, sizeof *table);
    if (table == NULL) return NULL;
    table->slots = calloc(max_regions > 0 ? max_regions : 1, sizeof *table->slots);
    if (table->slots == NULL) {
        free(table);
        return NULL;
    }
    table->max_regions = max_regions;
    table->next_id = 1;
    table->ops = ops;
    table->ops_ctx = ops_ctx;
    return table;
}

static void region_release(epd_region_t *region)
{
    if (region->kind == EPD_REGION_HOST) {
        if (region->page_locked) region->ops->host_unregister(region->ops_ctx, region->map);
        munmap(region->map, region->map_len);
    } else {
        region->ops->ipc_close(region->ops_ctx, region->map);
    }
    epd_log_debug("region %" PRIu32 " released", region->id);
    free(region);
}

void epd_region_ref(epd_region_t *region)
{
    atomic_fetch_add(&region->refs, 1);
}

void epd_region_unref(epd_region_t *region)
{
    if (region != NULL && atomic_fetch_sub(&region->refs, 1) == 1) region_release(region);
}

void epd_region_table_free(epd_region_table_t *table)
{
    if (table == NULL) return;
    for (uint32_t i = 0; i < table->max_regions; i++) epd_region_unref(table->slots[i]);
    free(table->slots);
    free(table);
}

/* A free slot, or bad_region when the connection holds socket.max_regions already. */
static epd_status_t table_slot(epd_region_table_t *table, uint32_t *slot_p, char err[EPD_ERR_LEN])
{
    for (uint32_t i = 0; i < table->max_regions; i++) {
        if (table->slots[i] == NULL) {
            *slot_p = i;
            return EPD_OK;
        }
    }
    snprintf(err, EPD_ERR_LEN,
             "this connection holds %" PRIu32 " regions, the most socket.max_regions allows; "
             "unregister one first", table->max_regions);
    return EPD_ERR_BAD_REGION;
}

static void table_put(epd_region_table_t *table, uint32_t slot, epd_region_t *region,
                      uint32_t *id_p)
{
    region->id = table->next_id++;
    atomic_init(&region->refs, 1);
    table->slots[slot] = region;
    *id_p = region->id;
}

epd_status_t epd_region_register_host(epd_region_table_t *table, int fd, uint64_t bytes,
                                      uint32_t *id_p, char err[EPD_ERR_LEN])
{
    struct stat st;
    uint32_t slot;
    epd_status_t status = table_slot(table, &slot, err);

    if (status != EPD_OK) goto out_close;
    status = EPD_ERR_BAD_REGION;
    if (bytes == 0 || bytes > SIZE_MAX) {
        snprintf(err, EPD_ERR_LEN, "a region needs \"bytes\" >= 1");
        goto out_close;
    }
    if (fstat(fd, &st) != 0) {
        snprintf(err, EPD_ERR_LEN, "fstat of the region's file descriptor: %s", strerror(errno));
        goto out_close;
    }
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size < bytes) {
        snprintf(err, EPD_ERR_LEN,
                 "the file descriptor is %s of %lld bytes, the region wants %" PRIu64
                 " (send a memfd or shared-memory fd at least that large)",
                 S_ISREG(st.st_mode) ? "a file" : "not a regular file or memfd",
                 (long long)st.st_size, bytes);
        goto out_close;
    }
    void *map = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        snprintf(err, EPD_ERR_LEN, "cannot map the region's %" PRIu64 " bytes: %s", bytes,
                 strerror(errno));
        goto out_close;
    }
    close(fd);
    epd_region_t *region = calloc(1, sizeof *region);
    if (region == NULL) {
        munmap(map, (size_t)bytes);
        snprintf(err, EPD_ERR_LEN, "out of memory");
        return EPD_ERR_INTERNAL;
    }
    *region = (epd_region_t){.kind = EPD_REGION_HOST, .bytes = bytes, .base = map, .map = map,
                             .map_len = (size_t)bytes, .ops = table->ops,
                             .ops_ctx = table->ops_ctx};
    if (table->ops->host_register != NULL) {
        char why[EPD_ERR_LEN] = "";
        if (table->ops->host_register(table->ops_ctx, map, (size_t)bytes, why) != EPD_OK) {
            munmap(map, (size_t)bytes);
            free(region);
            snprintf(err, EPD_ERR_LEN, "cannot page-lock the region: %.200s", why);
            return EPD_ERR_BAD_REGION;
        }
        region->page_locked = true;
    }
    table_put(table, slot, region, id_p);
    return EPD_OK;

out_close:
    close(fd);
    return status;
}

epd_status_t epd_region_register_cuda(epd_region_table_t *table, const uint8_t handle[64],
                                      uint64_t offset, uint64_t bytes, uint32_t *id_p,
                                      char err[EPD_ERR_LEN])
{
    uint32_t slot;
    void *base = NULL;
    uint64_t end;
    char why[EPD_ERR_LEN] = "";
    epd_status_t status = table_slot(table, &slot, err);

    if (status != EPD_OK) return status;
    if (table->ops->ipc_open == NULL) {
        snprintf(err, EPD_ERR_LEN,
                 "this daemon runs its experts on the host (device.backend); it cannot open CUDA "
                 "memory: register a host region instead");
        return EPD_ERR_BAD_REGION;
    }
    if (bytes == 0 || __builtin_add_overflow(offset, bytes, &end)) {
        snprintf(err, EPD_ERR_LEN, "a region needs \"bytes\" >= 1 and offset + bytes in range");
        return EPD_ERR_BAD_REGION;
    }
    uint64_t size = 0;
    if (table->ops->ipc_open(table->ops_ctx, handle, &base, &size, why) != EPD_OK) {
        snprintf(err, EPD_ERR_LEN, "cannot open the CUDA IPC handle: %.200s", why);
        return EPD_ERR_BAD_REGION;
    }
    if (size != 0 && end > size) {
        table->ops->ipc_close(table->ops_ctx, base);
        snprintf(err, EPD_ERR_LEN,
                 "offset %" PRIu64 " + bytes %" PRIu64 " is past the end of the %" PRIu64
                 "-byte allocation", offset, bytes, size);
        return EPD_ERR_BAD_REGION;
    }
    epd_region_t *region = calloc(1, sizeof *region);
    if (region == NULL) {
        table->ops->ipc_close(table->ops_ctx, base);
        snprintf(err, EPD_ERR_LEN, "out of memory");
        return EPD_ERR_INTERNAL;
    }
    *region = (epd_region_t){.kind = EPD_REGION_CUDA, .bytes = bytes,
                             .base = (uint8_t *)base + offset, .map = base, .ops = table->ops,
                             .ops_ctx = table->ops_ctx};
    table_put(table, slot, region, id_p);
    return EPD_OK;
}

epd_status_t epd_region_unregister(epd_region_table_t *table, uint32_t id, char err[EPD_ERR_LEN])
{
    for (uint32_t i = 0; i < table->max_regions; i++) {
        if (table->slots[i] != NULL && table->slots[i]->id == id) {
            epd_region_unref(table->slots[i]);
            table->slots[i] = NULL;
            return EPD_OK;
        }
    }
    snprintf(err, EPD_ERR_LEN, "region %" PRIu32 " is not registered on this connection", id);
    return EPD_ERR_BAD_REGION;
}

epd_region_t *epd_region_find(epd_region_table_t *table, uint32_t id)
{
    for (uint32_t i = 0; table != NULL && i < table->max_regions; i++)
        if (table->slots[i] != NULL && table->slots[i]->id == id) return table->slots[i];
    return NULL;
}

uint8_t *epd_region_base(const epd_region_t *region)
{
    return region->base;
}

uint64_t epd_region_bytes(const epd_region_t *region)
{
    return region->bytes;
}

bool epd_region_device(const epd_region_t *region)
{
    return region->kind == EPD_REGION_CUDA;
}

/* ---- the SUBMIT hooks ---- */

static epd_status_t hook_resolve(void *arg, uint32_t id, uint64_t begin, uint64_t end,
                                 epd_region_span_t *span_p, char err[EPD_ERR_LEN])
{
    epd_region_table_t *table = arg;

    for (uint32_t i = 0; i < table->max_regions; i++) {
        epd_region_t *region = table->slots[i];
        if (region == NULL || region->id != id) continue;
        if (end > region->bytes) {
            snprintf(err, EPD_ERR_LEN,
                     "bytes [%" PRIu64 ", %" PRIu64 ") are past the end of region %" PRIu32
                     " (%" PRIu64 " bytes)", begin, end, id, region->bytes);
            return EPD_ERR_BAD_REGION;
        }
        span_p->ptr = region->base + begin;
        span_p->device = region->kind == EPD_REGION_CUDA;
        span_p->region = region;
        return EPD_OK;
    }
    snprintf(err, EPD_ERR_LEN, "region %" PRIu32 " is not registered on this connection", id);
    return EPD_ERR_BAD_REGION;
}

static epd_status_t hook_device_fetch(void *arg, const void *ids, size_t ids_bytes, void *ids_dst,
                                      const void *w, size_t w_bytes, void *w_dst,
                                      const uint16_t *x, uint64_t x_n, int64_t *x_bad_p,
                                      char err[EPD_ERR_LEN])
{
    epd_region_table_t *table = arg;
    char why[EPD_ERR_LEN] = "";

    uint64_t start = epd_now_ns();
    epd_status_t status = table->ops->ingest_fetch(table->ops_ctx, ids, ids_bytes, ids_dst, w,
                                                   w_bytes, w_dst, x, x_n, x_bad_p, why);
    table->fetch_ns += epd_now_ns() - start;
    if (status == EPD_OK) return EPD_OK;
    snprintf(err, EPD_ERR_LEN, "reading device tensors failed: %.200s", why);
    return EPD_ERR_BAD_REGION;
}

uint64_t epd_region_take_fetch_ns(epd_region_table_t *table)
{
    uint64_t ns = table->fetch_ns;
    table->fetch_ns = 0;
    return ns;
}

void epd_region_submit_hooks(epd_region_table_t *table, epd_submit_regions_t *hooks_p)
{
    *hooks_p = (epd_submit_regions_t){
        .arg = table,
        .resolve = hook_resolve,
        .device_fetch = table->ops->ingest_fetch != NULL ? hook_device_fetch : NULL,
    };
}
