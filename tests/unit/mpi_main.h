/* main() for the unit tests that need MPI (a singleton world): MPI_Init_thread as the daemon calls
 * it, the test group, MPI_Finalize. Under ASan, what MPI_Init allocates is Open MPI's (it keeps it,
 * and unloads it at finalize where LeakSanitizer cannot attribute it): ignored, and leaks are
 * checked before MPI_Finalize instead. */
#ifndef EPD_TESTS_UNIT_MPI_MAIN_H
#define EPD_TESTS_UNIT_MPI_MAIN_H

#include <mpi.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

/* Runs run() (which calls cmocka_run_group_tests) inside MPI; returns its result. */
static inline int epd_test_mpi_main(int argc, char **argv, int (*run)(void))
{
    int provided, rc;

#if defined(__SANITIZE_ADDRESS__)
    __lsan_disable();
#endif
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
#if defined(__SANITIZE_ADDRESS__)
    __lsan_enable();
#endif
    rc = run();
#if defined(__SANITIZE_ADDRESS__)
    __lsan_do_leak_check();
#endif
    MPI_Finalize();
    return rc;
}

#endif
