/* sd_notify(3) in a few lines: a datagram to $NOTIFY_SOCKET, as Slurm and memcached do it. */
#include "daemon/notify.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

epd_status_t epd_notify_send(const char *socket_name, const char *state, bool *sent_p,
                             char err[EPD_ERR_LEN])
{
    struct sockaddr_un addr;
    size_t name_len;
    socklen_t addr_len;
    epd_status_t status = EPD_OK;
    int fd;

    *sent_p = false;
    if (socket_name == NULL || socket_name[0] == '\0') return EPD_OK;

    name_len = strlen(socket_name);
    if ((socket_name[0] != '/' && socket_name[0] != '@') || name_len >= sizeof(addr.sun_path)) {
        snprintf(err, EPD_ERR_LEN,
                 "NOTIFY_SOCKET '%s' is not an absolute path or an abstract name starting with '@' "
                 "of at most %zu bytes", socket_name, sizeof(addr.sun_path) - 1);
        return EPD_ERR_INVALID_ARG;
    }
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, socket_name, name_len);
    if (addr.sun_path[0] == '@') {
        /* Abstract namespace: the name is the bytes after a leading NUL, not NUL-terminated. */
        addr.sun_path[0] = '\0';
        addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + name_len);
    } else {
        addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + name_len + 1);
    }

    fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(err, EPD_ERR_LEN, "NOTIFY_SOCKET: socket(): %s", strerror(errno));
        return EPD_ERR_IO;
    }
    size_t len = strlen(state);
    ssize_t n = sendto(fd, state, len, MSG_NOSIGNAL, (struct sockaddr *)&addr, addr_len);
    if (n < 0 || (size_t)n != len) {
        snprintf(err, EPD_ERR_LEN, "NOTIFY_SOCKET '%s': sendto(): %s", socket_name,
                 n < 0 ? strerror(errno) : "short datagram");
        status = EPD_ERR_IO;
        goto out_close;
    }
    *sent_p = true;
out_close:
    close(fd);
    return status;
}
