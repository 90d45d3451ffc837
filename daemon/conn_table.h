/* The live connections of a rank by id, and the routing of engine results to them: a result
 * whose connection is gone is discarded and counted. Keeps the clients counters. Loop thread
 * only. */
#ifndef EPD_DAEMON_CONN_TABLE_H
#define EPD_DAEMON_CONN_TABLE_H

#include <stdint.h>

#include "common/status.h"
#include "daemon/conn.h"
#include "daemon/engine.h"
#include "daemon/stats.h"

typedef struct epd_conn_table epd_conn_table_t;

/* An empty table that counts clients and discarded results in stats (which must outlive it).
 * NULL when out of memory. */
epd_conn_table_t *epd_conn_table_create(epd_server_stats_t *stats);

/* Frees the table itself; the connections in it are the caller's to close first. */
void epd_conn_table_free(epd_conn_table_t *table);

/* Adds conn under its id (never reused within a run). EPD_ERR_NO_MEMORY leaves it out. */
epd_status_t epd_conn_table_add(epd_conn_table_t *table, epd_conn_t *conn);

/* Takes conn out (it is going away) and logs whether answers were still due to it; a conn that
 * is not in the table is ignored. */
void epd_conn_table_remove(epd_conn_table_t *table, epd_conn_t *conn);

/* The live connection with this id, or NULL. */
epd_conn_t *epd_conn_table_find(epd_conn_table_t *table, uint64_t id);

/* Connections in the table now. */
uint64_t epd_conn_table_count(const epd_conn_table_t *table);

/* Calls fn on every connection live now; fn may free its connection (and others: each is looked
 * up again just before its turn). */
void epd_conn_table_each(epd_conn_table_t *table, void (*fn)(epd_conn_t *conn));

/* Hands result to its connection, or frees it and counts it discarded when that connection is
 * gone. Takes ownership of result. */
void epd_conn_table_deliver(epd_conn_table_t *table, epd_result_t *result);

#endif
