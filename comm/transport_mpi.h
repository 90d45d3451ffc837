/* The `mpi` transport (DESIGN.md section 7): MPI_Alltoallv directly on the step's buffers (host
 * memory, or device memory where MPI is CUDA-aware), counts in items of an MPI contiguous datatype
 * of item_bytes so that a step's byte counts never overflow an int. It serves host ops always and
 * device ops when epd_mpi_cuda_direct says MPI takes their buffers. */
#ifndef EPD_COMM_TRANSPORT_MPI_H
#define EPD_COMM_TRANSPORT_MPI_H

#include <mpi.h>
#include <stdint.h>

#include "comm/transport.h"
#include "common/status.h"

extern const epd_transport_t epd_transport_mpi;

/* Converts n 64-bit counts and displacements (in items) into the int arrays MPI_Alltoallv takes.
 * EPD_ERR_INVALID_ARG with a sentence in err naming the peer and the value when one does not fit
 * in an int (the caller should use a larger item). */
epd_status_t epd_mpi_counts_to_int(const uint64_t *counts, const uint64_t *displs, int n,
                                   int *counts_out, int *displs_out, char err[EPD_ERR_LEN]);

#endif
