/* libFuzzer harness of the configuration loader: each input is a YAML file handed to
 * epd_config_load (libyaml events, line numbers, type and range checks, cross-field rules). A
 * crash, a leak or a sanitizer report is a finding; an error status is an ordinary outcome, but it
 * must come with a message. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config/config.h"

static char path[64];

static void remove_input(void)
{
    unlink(path);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (path[0] == '\0') {
        snprintf(path, sizeof(path), "/tmp/epd-fuzz-config-%d.yaml", (int)getpid());
        atexit(remove_input);
    }
    FILE *f = fopen(path, "wb");
    if (f == NULL) abort();
    if (size > 0 && fwrite(data, 1, size, f) != size) abort();
    fclose(f);

    char *envp[] = {NULL};
    epd_config_sources_t sources = {.file = path, .envp = envp};
    epd_config_state_t *state = NULL;
    char err[EPD_ERR_LEN] = "";
    epd_status_t status = epd_config_load(&sources, &state, err);
    if (status == EPD_OK) {
        if (state == NULL) abort();
        char json[8192];
        epd_config_to_json(epd_config_get(state), json, sizeof(json));
        epd_config_state_free(state);
    } else if (state != NULL || err[0] == '\0') {
        abort(); /* a refusal leaves nothing behind and says why */
    }
    return 0;
}
