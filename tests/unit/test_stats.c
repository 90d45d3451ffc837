/* Unit tests of daemon/stats: the health and stats JSON documents and the Prometheus text. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "daemon/stats.h"

static epd_engine_stats_t engine;
static epd_server_stats_t server;

static epd_stats_view_t make_view(void)
{
    memset(&engine, 0, sizeof(engine));
    memset(&server, 0, sizeof(server));
    engine.steps = (1ull << 60) + 1; /* above 2^53: must stay exact */
    engine.tokens = 1000;
    engine.requests = 40;
    engine.queued_tokens = 7;
    engine.queued_requests = 2;
    engine.bytes_sent[EPD_WIRE_FP8] = 540000;
    engine.phase_ns[EPD_PHASE_DISPATCH] = 1500000000ull;
    engine.shutting_down = true;
    server.clients = 3;
    server.clients_total = 9;
    server.requests_accepted = 42;
    server.results_discarded = 5;
    server.errors[EPD_ERR_BUSY] = 4;
    server.errors[EPD_ERR_BAD_MAGIC] = 1;
    server.bytes_in = 123456;
    epd_stats_view_t view = {.rank = 1, .world = 4, .uptime_s = 2.5, .dtype = EPD_WIRE_FP8,
                             .engine = &engine, .server = &server};
    return view;
}

static void test_stats__health__valid_json_with_identity(void **state)
{
    (void)state;
    epd_stats_view_t view = make_view();
    char *text = epd_stats_health_json(&view);
    assert_non_null(text);
    cJSON *doc = cJSON_Parse(text);
    assert_non_null(doc);
    assert_string_equal(cJSON_GetObjectItem(doc, "status")->valuestring, "ok");
    assert_int_equal(cJSON_GetObjectItem(doc, "rank")->valueint, 1);
    assert_int_equal(cJSON_GetObjectItem(doc, "world")->valueint, 4);
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(doc, "shutting_down")));
    assert_int_equal(cJSON_GetObjectItem(doc, "clients")->valueint, 3);
    cJSON_Delete(doc);
    free(text);
}

static void test_stats__stats__counters_exact_and_nested(void **state)
{
    (void)state;
    epd_stats_view_t view = make_view();
    char *text = epd_stats_json(&view);
    assert_non_null(text);
    cJSON *doc = cJSON_Parse(text);
    assert_non_null(doc);
    assert_non_null(strstr(text, "\"steps\":1152921504606846977"));
    cJSON *eng = cJSON_GetObjectItem(doc, "engine");
    cJSON *srv = cJSON_GetObjectItem(doc, "server");
    assert_non_null(eng);
    assert_non_null(srv);
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(eng, "bytes_sent"), "fp8")->valueint,
                     540000);
    assert_true(cJSON_GetObjectItem(cJSON_GetObjectItem(eng, "phase_seconds"), "dispatch")
                    ->valuedouble == 1.5);
    assert_true(cJSON_GetObjectItem(doc, "bytes_per_token")->valuedouble == 540.0);
    assert_string_equal(cJSON_GetObjectItem(doc, "dtype")->valuestring, "fp8");
    assert_int_equal(cJSON_GetObjectItem(srv, "requests_accepted")->valueint, 42);
    assert_int_equal(cJSON_GetObjectItem(srv, "results_discarded")->valueint, 5);
    assert_int_equal(cJSON_GetObjectItem(srv, "bytes_in")->valueint, 123456);
    cJSON *errors = cJSON_GetObjectItem(srv, "errors");
    assert_int_equal(cJSON_GetObjectItem(errors, "busy")->valueint, 4);
    assert_int_equal(cJSON_GetObjectItem(errors, "bad_magic")->valueint, 1);
    assert_int_equal(cJSON_GetObjectItem(errors, "internal")->valueint, 0);
    /* Only wire codes are listed. */
    assert_null(cJSON_GetObjectItem(errors, "no_memory"));
    assert_null(cJSON_GetObjectItem(errors, "ok"));
    cJSON_Delete(doc);
    free(text);
}

/* Every sample line's metric has HELP and TYPE lines before it. */
static void check_exposition(const char *text)
{
    char *copy = strdup(text);
    char typed[128][64];
    int n_typed = 0;
    for (char *line = strtok(copy, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        if (strncmp(line, "# HELP ", 7) == 0) continue;
        if (strncmp(line, "# TYPE ", 7) == 0) {
            assert_true(n_typed < 128);
            sscanf(line + 7, "%63s", typed[n_typed++]);
            continue;
        }
        char name[64];
        size_t len = strcspn(line, "{ ");
        assert_true(len > 0 && len < sizeof(name));
        memcpy(name, line, len);
        name[len] = '\0';
        bool found = false;
        for (int i = 0; i < n_typed; i++) {
            size_t n = strlen(typed[i]);
            /* a histogram's samples are NAME_bucket, NAME_sum and NAME_count */
            found = found || strcmp(typed[i], name) == 0 ||
                    (strncmp(typed[i], name, n) == 0 &&
                     (strcmp(name + n, "_bucket") == 0 || strcmp(name + n, "_sum") == 0 ||
                      strcmp(name + n, "_count") == 0));
        }
        if (!found) fail_msg("sample '%s' has no TYPE line", line);
    }
    free(copy);
}

static void test_stats__metrics__prometheus_text(void **state)
{
    (void)state;
    epd_stats_view_t view = make_view();
    char *text = epd_stats_metrics(&view);
    assert_non_null(text);
    check_exposition(text);
    const char *expected[] = {
        "# TYPE epd_steps_total counter\n",
        "epd_steps_total 1152921504606846977\n",
        "epd_tokens_total 1000\n",
        "epd_bytes_sent_total{dtype=\"fp8\"} 540000\n",
        "epd_bytes_sent_total{dtype=\"bf16\"} 0\n",
        "epd_step_phase_seconds_total{phase=\"dispatch\"} 1.500000000\n",
        "epd_step_phase_seconds_total{phase=\"reduce\"} 0.000000000\n",
        "# TYPE epd_queue_tokens gauge\n",
        "epd_queue_tokens 7\n",
        "epd_errors_total{code=\"busy\"} 4\n",
        "epd_errors_total{code=\"shutting_down\"} 0\n",
        "epd_clients 3\n",
        "epd_requests_total 42\n",
        "epd_results_discarded_total 5\n",
        "# HELP epd_results_discarded_total ",
        "epd_info{rank=\"1\",world=\"4\",",
    };
    for (size_t i = 0; i < sizeof(expected) / sizeof(expected[0]); i++)
        if (strstr(text, expected[i]) == NULL) fail_msg("missing: %s", expected[i]);
    assert_null(strstr(text, "code=\"no_memory\""));
    assert_int_equal(text[strlen(text) - 1], '\n');
    free(text);
}

static void test_stats__recorder__histograms_and_expert_counters(void **state)
{
    (void)state;
    epd_stats_view_t view = make_view();
    epd_metrics_t *m = epd_metrics_create(8, 2);
    assert_non_null(m);
    server.metrics = m;
    epd_metrics_observe_request(m, 2000000);           /* 2 ms */
    epd_metrics_observe_request(m, 20000000000ull);    /* 20 s: only +Inf */
    epd_step_timing_t tm = {.total_ns = 1000000, .n_tokens = 3};
    tm.phase_ns[EPD_PHASE_DISPATCH] = 30000;           /* 30 us */
    const int32_t ids[] = {0, 1, 3, -1, 0, 7};
    const uint32_t rows[] = {3, 0, 1}; /* this rank's experts 4, 5, 6 (from the count exchange) */
    tm.local_expert_rows = rows;
    tm.local_first = 4;
    tm.n_local = 3;
    epd_metrics_observe_step(m, &tm, 5, ids, 3);
    epd_step_timing_t idle = {.total_ns = 100000};
    epd_metrics_observe_step(m, &idle, 2, NULL, 0);     /* took part with nothing */
    epd_metrics_observe_step(m, &tm, 1, ids, 1);        /* another layer, first token only */

    char *text = epd_stats_metrics(&view);
    assert_non_null(text);
    check_exposition(text);
    const char *expected[] = {
        "# TYPE epd_request_latency_seconds histogram\n",
        "epd_request_latency_seconds_bucket{le=\"0.001\"} 0\n",
        "epd_request_latency_seconds_bucket{le=\"0.0025\"} 1\n",
        "epd_request_latency_seconds_bucket{le=\"10\"} 1\n",
        "epd_request_latency_seconds_bucket{le=\"+Inf\"} 2\n",
        "epd_request_latency_seconds_sum 20.002\n",
        "epd_request_latency_seconds_count 2\n",
        "epd_step_duration_seconds_bucket{le=\"0.0001\"} 1\n",
        "epd_step_duration_seconds_bucket{le=\"0.001\"} 3\n",
        "epd_step_duration_seconds_count 3\n",
        "epd_step_phase_duration_seconds_bucket{phase=\"dispatch\",le=\"2.5e-05\"} 1\n",
        "epd_step_phase_duration_seconds_bucket{phase=\"dispatch\",le=\"5e-05\"} 3\n",
        "epd_step_phase_duration_seconds_count{phase=\"dispatch\"} 3\n",
        "epd_step_phase_duration_seconds_sum{phase=\"reduce\"} 0\n",
        "epd_step_tokens_bucket{le=\"0\"} 1\n",
        "epd_step_tokens_bucket{le=\"1\"} 2\n",
        "epd_step_tokens_bucket{le=\"2\"} 2\n",
        "epd_step_tokens_bucket{le=\"4\"} 3\n",
        "epd_step_tokens_sum 4\n",
        "# TYPE epd_expert_routed_tokens_total counter\n",
        "epd_expert_routed_tokens_total{layer=\"5\",expert=\"0\"} 2\n",
        "epd_expert_routed_tokens_total{layer=\"5\",expert=\"1\"} 1\n",
        "epd_expert_routed_tokens_total{layer=\"5\",expert=\"2\"} 0\n",
        "epd_expert_routed_tokens_total{layer=\"5\",expert=\"7\"} 1\n",
        "epd_expert_routed_tokens_total{layer=\"1\",expert=\"0\"} 1\n",
        "epd_expert_untracked_tokens_total 0\n",
        "# TYPE epd_expert_tokens_total counter\n",
        "epd_expert_tokens_total{layer=\"5\",expert=\"4\"} 3\n",
        "epd_expert_tokens_total{layer=\"5\",expert=\"5\"} 0\n",
        "epd_expert_tokens_total{layer=\"5\",expert=\"6\"} 1\n",
        "epd_expert_tokens_total{layer=\"1\",expert=\"4\"} 3\n",
    };
    for (size_t i = 0; i < sizeof(expected) / sizeof(expected[0]); i++)
        if (strstr(text, expected[i]) == NULL) fail_msg("missing: %s", expected[i]);
    /* layers in order, a layer without tokens has no series, empty slots are not counted */
    assert_true(strstr(text, "layer=\"1\"") < strstr(text, "layer=\"5\""));
    assert_null(strstr(text, "layer=\"2\""));
    assert_null(strstr(text, "expert=\"8\""));
    /* only this rank's experts have a series of tokens run */
    assert_null(strstr(text, "epd_expert_tokens_total{layer=\"5\",expert=\"3\"}"));
    assert_null(strstr(text, "epd_expert_tokens_total{layer=\"5\",expert=\"7\"}"));
    free(text);
    server.metrics = NULL;
    epd_metrics_free(m);
}

static void test_stats__quant_error__per_step_folded_and_documented(void **state)
{
    (void)state;
    epd_stats_view_t view = make_view();
    /* two FP8-dispatch steps (relative RMS 0.03 then 0.01), one of them with FP8 partials
     * (0.02); a step with nothing quantized changes nothing */
    const epd_quant_error_t steps[] = {
        {.dispatch_err2 = 0.09, .dispatch_ref2 = 100.0, .combine_err2 = 0.04,
         .combine_ref2 = 100.0},
        {.dispatch_err2 = 0.0, .dispatch_ref2 = 0.0, .combine_err2 = 0.0, .combine_ref2 = 0.0},
        {.dispatch_err2 = 0.03, .dispatch_ref2 = 300.0},
    };
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++)
        epd_quant_stats_add(&engine.quant_error, &steps[i]);
    const epd_quant_stats_t *q = &engine.quant_error;
    assert_int_equal(q->steps[EPD_QUANT_DISPATCH], 2);
    assert_int_equal(q->steps[EPD_QUANT_COMBINE], 1);
    assert_true(fabs(q->last[EPD_QUANT_DISPATCH] - 0.01) < 1e-12);
    assert_true(fabs(q->max[EPD_QUANT_DISPATCH] - 0.03) < 1e-12);
    assert_true(epd_quant_relative_rms(0.0, 0.0) < 0.0);

    char *text = epd_stats_json(&view);
    assert_non_null(text);
    cJSON *doc = cJSON_Parse(text);
    assert_non_null(doc);
    cJSON *qe = cJSON_GetObjectItem(cJSON_GetObjectItem(doc, "engine"), "quant_error");
    cJSON *disp = cJSON_GetObjectItem(qe, "dispatch"), *comb = cJSON_GetObjectItem(qe, "combine");
    assert_non_null(disp);
    assert_non_null(comb);
    assert_int_equal(cJSON_GetObjectItem(disp, "steps")->valueint, 2);
    assert_true(fabs(cJSON_GetObjectItem(disp, "max")->valuedouble - 0.03) < 1e-6);
    /* overall: sqrt(0.12 / 400) */
    assert_true(fabs(cJSON_GetObjectItem(disp, "overall")->valuedouble - sqrt(0.12 / 400.0)) <
                1e-6);
    assert_true(fabs(cJSON_GetObjectItem(comb, "last")->valuedouble - 0.02) < 1e-6);
    cJSON_Delete(doc);
    free(text);

    /* before any step: steps 0 and the values 0 (numbers always, never NaN or null) */
    memset(&engine.quant_error, 0, sizeof engine.quant_error);
    text = epd_stats_json(&view);
    doc = cJSON_Parse(text);
    assert_non_null(doc);
    qe = cJSON_GetObjectItem(cJSON_GetObjectItem(doc, "engine"), "quant_error");
    const cJSON *comb0 = cJSON_GetObjectItem(qe, "combine");
    assert_true(cJSON_IsNumber(cJSON_GetObjectItem(comb0, "last")));
    assert_true(cJSON_GetObjectItem(comb0, "last")->valuedouble == 0.0);
    assert_true(cJSON_GetObjectItem(comb0, "steps")->valuedouble == 0.0);
    cJSON_Delete(doc);
    free(text);

    epd_quant_stats_add(&engine.quant_error, &steps[0]);
    text = epd_stats_metrics(&view);
    assert_non_null(text);
    check_exposition(text);
    const char *expected[] = {
        "# TYPE epd_quant_error_relative_rms gauge\n",
        "epd_quant_error_relative_rms{direction=\"dispatch\"} 0.03\n",
        "epd_quant_error_relative_rms{direction=\"combine\"} 0.02\n",
        "epd_quant_error_steps_total{direction=\"combine\"} 1\n",
        "# TYPE epd_quant_error_squared_sum_total counter\n",
        "epd_quant_reference_squared_sum_total{direction=\"dispatch\"} 100\n",
    };
    for (size_t i = 0; i < sizeof(expected) / sizeof(expected[0]); i++)
        if (strstr(text, expected[i]) == NULL) fail_msg("missing: %s", expected[i]);
    free(text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stats__health__valid_json_with_identity),
        cmocka_unit_test(test_stats__stats__counters_exact_and_nested),
        cmocka_unit_test(test_stats__metrics__prometheus_text),
        cmocka_unit_test(test_stats__recorder__histograms_and_expert_counters),
        cmocka_unit_test(test_stats__quant_error__per_step_folded_and_documented),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
