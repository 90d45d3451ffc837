/* The staged `mpi` transport (DESIGN.md section 7) for an MPI that is not CUDA-aware: device
 * buffers go through pinned host memory in chunks, with the device copies (the ops' async hooks)
 * overlapping the MPI messages. No CUDA header here: comm/ only sees gpu/ops.h. */
#ifndef EPD_COMM_TRANSPORT_STAGED_H
#define EPD_COMM_TRANSPORT_STAGED_H

#include "comm/transport.h"

/* Chunk size in bytes when EPD_TEST_STAGED_CHUNK does not set one (tests and tuning only). */
#define EPD_STAGED_CHUNK_BYTES (2u << 20)
#define EPD_STAGED_CHUNK_ENV "EPD_TEST_STAGED_CHUNK"
#define EPD_STAGED_CHUNK_MAX (1u << 30)

/* Serves device memory (the registry tries it after direct mpi and nccl). Needs ops with
 * stream-independent async copies and events (alloc_host, event_*, copy_*_async); init refuses
 * ops without them. init is collective over comm (it duplicates it). */
extern const epd_transport_t epd_transport_mpi_staged;

#endif
