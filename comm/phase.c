/* The names of the step's phases (comm/step.h), on their own so that stats and their tests need
 * no step. */
#include "comm/step.h"

const char *const epd_phase_names[EPD_PHASE_MAX] = {
    [EPD_PHASE_LAYOUT_PACK] = "pack",   [EPD_PHASE_COUNTS] = "counts",
    [EPD_PHASE_DISPATCH] = "dispatch",  [EPD_PHASE_EXPERTS] = "experts",
    [EPD_PHASE_COMBINE] = "combine",    [EPD_PHASE_REDUCE] = "reduce",
};
