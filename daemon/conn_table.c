/* The connection table (daemon/conn_table.h): a fixed array of hash buckets over the connection
 * id, each a list of nodes. */
#include "daemon/conn_table.h"

#include <inttypes.h>
#include <stdlib.h>

#include "daemon/log.h"

#define CONN_TABLE_BUCKETS 1024 /* a power of two */

typedef struct conn_node {
    uint64_t id;
    epd_conn_t *conn;
    struct conn_node *next;
} conn_node_t;

struct epd_conn_table {
    epd_server_stats_t *stats; /* clients: the nodes in the buckets */
    conn_node_t *buckets[CONN_TABLE_BUCKETS];
};

static conn_node_t **table_slot(epd_conn_table_t *table, uint64_t id)
{
    conn_node_t **slot = &table->buckets[id & (CONN_TABLE_BUCKETS - 1)];
    while (*slot != NULL && (*slot)->id != id) slot = &(*slot)->next;
    return slot;
}

epd_conn_table_t *epd_conn_table_create(epd_server_stats_t *stats)
{
    epd_conn_table_t *table = calloc(1, sizeof(*table));
    if (table != NULL) table->stats = stats;
    return table;
}

void epd_conn_table_free(epd_conn_table_t *table)
{
    if (table == NULL) return;
    for (size_t b = 0; b < CONN_TABLE_BUCKETS; b++) {
        conn_node_t *node = table->buckets[b];
        while (node != NULL) {
            conn_node_t *next = node->next;
            free(node);
            node = next;
        }
    }
    free(table);
}

epd_status_t epd_conn_table_add(epd_conn_table_t *table, epd_conn_t *conn)
{
    conn_node_t *node = malloc(sizeof(*node));

    if (node == NULL) return EPD_ERR_NO_MEMORY;
    node->id = epd_conn_id(conn);
    node->conn = conn;
    node->next = NULL;
    *table_slot(table, node->id) = node;
    table->stats->clients++;
    table->stats->clients_total++;
    return EPD_OK;
}

void epd_conn_table_remove(epd_conn_table_t *table, epd_conn_t *conn)
{
    conn_node_t **slot = table_slot(table, epd_conn_id(conn));
    conn_node_t *node = *slot;

    if (node == NULL) return;
    *slot = node->next;
    free(node);
    table->stats->clients--;
    uint64_t pending = epd_conn_in_flight(conn);
    if (pending > 0)
        epd_log_info("conn %" PRIu64 " closed with %" PRIu64 " requests in flight; their results "
                     "will be discarded", epd_conn_id(conn), pending);
    else
        epd_log_debug("conn %" PRIu64 " closed", epd_conn_id(conn));
}

epd_conn_t *epd_conn_table_find(epd_conn_table_t *table, uint64_t id)
{
    conn_node_t *node = *table_slot(table, id);
    return node ? node->conn : NULL;
}

uint64_t epd_conn_table_count(const epd_conn_table_t *table)
{
    return table->stats->clients;
}

void epd_conn_table_each(epd_conn_table_t *table, void (*fn)(epd_conn_t *conn))
{
    uint64_t cap = table->stats->clients + 1;
    size_t n = 0;
    /* The ids first: fn changes the table under us. */
    uint64_t *ids = malloc(cap * sizeof(*ids));

    if (ids == NULL) return;
    for (size_t b = 0; b < CONN_TABLE_BUCKETS; b++)
        for (conn_node_t *node = table->buckets[b]; node != NULL && n < cap; node = node->next)
            ids[n++] = node->id;
    for (size_t i = 0; i < n; i++) {
        epd_conn_t *conn = epd_conn_table_find(table, ids[i]);
        if (conn != NULL) fn(conn);
    }
    free(ids);
}

void epd_conn_table_deliver(epd_conn_table_t *table, epd_result_t *result)
{
    epd_conn_t *conn = epd_conn_table_find(table, result->conn_id);

    if (conn != NULL) {
        epd_conn_deliver(conn, result);
        return;
    }
    table->stats->results_discarded++;
    epd_log_debug("result of request %" PRIu64 " discarded: conn %" PRIu64 " is gone",
                  result->id, result->conn_id);
    epd_result_free(result);
}
