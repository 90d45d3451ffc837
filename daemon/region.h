/* Shared regions of one connection (DESIGN.md section 4b): host memory the client shares with a
 * file descriptor (mapped, and page-locked when the ops have device memory), and device memory
 * it shares with a CUDA IPC handle. A SUBMIT names tensors by (region, offset); each request holds
 * a reference on the regions it uses, so unregistering, or closing the connection, releases a
 * region once the requests using it are answered. The table is the connection's (loop thread);
 * references may be dropped on any thread (the engine frees requests on its worker). */
#ifndef EPD_DAEMON_REGION_H
#define EPD_DAEMON_REGION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "gpu/ops.h"
#include "proto/frame.h"

typedef enum { EPD_REGION_HOST = 0, EPD_REGION_CUDA } epd_region_kind_t;

typedef struct epd_region epd_region_t;
typedef struct epd_region_table epd_region_table_t;

/* A table of at most max_regions regions; ops (may be the host ops) pages-lock host regions and
 * open device ones. NULL when out of memory. */
epd_region_table_t *epd_region_table_create(uint32_t max_regions, const epd_ops_t *ops,
                                            epd_ops_ctx_t *ops_ctx);
/* Unregisters every region (each goes once its requests are answered) and frees the table. */
void epd_region_table_free(epd_region_table_t *table);

/* Registers `bytes` of the shared memory behind fd (taken over: closed on every path). The fd must
 * be at least that large; it is mapped shared. EPD_OK with *id_p, or bad_region with a sentence. */
epd_status_t epd_region_register_host(epd_region_table_t *table, int fd, uint64_t bytes,
                                      uint32_t *id_p, char err[EPD_ERR_LEN]);
/* Registers `bytes` at `offset` into the allocation of a 64-byte cudaIpcMemHandle_t. */
epd_status_t epd_region_register_cuda(epd_region_table_t *table, const uint8_t handle[64],
                                      uint64_t offset, uint64_t bytes, uint32_t *id_p,
                                      char err[EPD_ERR_LEN]);
/* Removes region id from the table (bad_region when there is none); its memory goes once the
 * last request using it is answered. */
epd_status_t epd_region_unregister(epd_region_table_t *table, uint32_t id, char err[EPD_ERR_LEN]);

/* The time the table's hooks spent reading device tensors since the last call (ns; EPD_TRACE's
 * "device ingest" leg), and starts over. */
uint64_t epd_region_take_fetch_ns(epd_region_table_t *table);

/* The epd_submit_regions_t of this table, for epd_submit_validate_regions. */
void epd_region_submit_hooks(epd_region_table_t *table, epd_submit_regions_t *hooks_p);

/* The region registered under id in the table (no reference taken), or NULL. */
epd_region_t *epd_region_find(epd_region_table_t *table, uint32_t id);

/* A region's first byte (the host mapping, or device memory), its size and kind. */
uint8_t *epd_region_base(const epd_region_t *region);
uint64_t epd_region_bytes(const epd_region_t *region);
bool epd_region_device(const epd_region_t *region);

/* References of a request on the regions its tensors named (span.region values). */
void epd_region_ref(epd_region_t *region);
void epd_region_unref(epd_region_t *region);

#endif
