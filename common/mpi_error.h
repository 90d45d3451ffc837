/* MPI's error text for a return code, for the messages of every part that calls MPI. Header-only
 * so that common/ itself does not link MPI. */
#ifndef EPD_COMMON_MPI_ERROR_H
#define EPD_COMMON_MPI_ERROR_H

#include <mpi.h>
#include <stdio.h>

/* Writes MPI_Error_string(rc) into text (or "code N" when MPI cannot say) and returns text. */
static inline const char *epd_mpi_error_text(int rc, char text[MPI_MAX_ERROR_STRING])
{
    int len = 0;

    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS)
        snprintf(text, MPI_MAX_ERROR_STRING, "code %d", rc);
    return text;
}

#endif
