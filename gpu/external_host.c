/* External experts on the host (gpu/external.h): the row plan, the gather of the worker's input
 * rows and the partials from its outputs, on host memory. The host ops' daemon runs these; the
 * CUDA twins give the same bytes. */
#include "gpu/external.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bf16.h"
#include "gpu/fp8.h"
#include "gpu/quant.h"

epd_status_t epd_external_plan_rows(epd_external_plan_t *plan, char err[EPD_ERR_LEN])
{
    uint32_t at = 0;

    for (uint32_t e = 0; e < plan->n_local; e++) {
        uint32_t rows = plan->expert_rows[e];
        if (plan->layout == EPD_EXTERNAL_MASKED) {
            if (rows > plan->capacity) {
                snprintf(err, EPD_ERR_LEN,
                         "expert %u has %u rows this step, over experts.external_capacity = %u",
                         plan->first_expert + e, rows, plan->capacity);
                return EPD_ERR_INVALID_ARG;
            }
            plan->first_row[e] = e * plan->capacity;
        } else {
            plan->first_row[e] = at;
            at += rows;
        }
    }
    plan->n_rows = plan->layout == EPD_EXTERNAL_MASKED ? plan->n_local * plan->capacity : at;
    return EPD_OK;
}

size_t epd_external_row_bytes(const epd_moe_shape_t *shape, epd_external_input_t input)
{
    return input == EPD_EXTERNAL_BF16 ? (size_t)shape->hidden * 2 : shape->hidden;
}

epd_scale_kind_t epd_external_scale_kind(const epd_moe_shape_t *shape)
{
    return shape->dtype == EPD_WIRE_FP8 ? shape->scale : EPD_SCALE_GROUP128;
}

uint32_t epd_external_row_scales(const epd_moe_shape_t *shape, epd_external_input_t input)
{
    if (input != EPD_EXTERNAL_FP8_GROUP128) return 0;
    return epd_quant_n_scales(shape->hidden, epd_external_scale_kind(shape));
}

void epd_external_ids_host(const epd_moe_shape_t *shape, const epd_external_plan_t *plan,
                           int32_t *ids)
{
    epd_record_layout_t rec;
    size_t j = 0;

    epd_record_layout(shape, &rec);
    for (uint32_t s = 0; s < plan->n_segments; s++) {
        const epd_external_segment_t *seg = &plan->segments[s];
        for (uint32_t r = 0; r < seg->count; r++, j++)
            memcpy(ids + j * shape->topk,
                   (const uint8_t *)seg->records + (size_t)r * rec.size + rec.ids,
                   shape->topk * sizeof(int32_t));
    }
}

epd_status_t epd_external_map(const epd_moe_shape_t *shape, const epd_external_plan_t *plan,
                              const int32_t *ids, int32_t *row_of, char err[EPD_ERR_LEN])
{
    uint32_t K = shape->topk, n_local = plan->n_local;
    int32_t lo = (int32_t)plan->first_expert, hi = lo + (int32_t)n_local;
    uint32_t *cursor = calloc(n_local > 0 ? n_local : 1, sizeof *cursor);

    if (cursor == NULL) {
        snprintf(err, EPD_ERR_LEN, "external experts: out of host memory");
        return EPD_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < (size_t)plan->n_records * K; i++) {
        int32_t e = ids[i], row = -1;
        if (e >= lo && e < hi) {
            uint32_t le = (uint32_t)(e - lo);
            if (cursor[le] == plan->expert_rows[le]) {
                snprintf(err, EPD_ERR_LEN, "external experts: expert %d has more rows than the "
                         "%u the count exchange said", e, plan->expert_rows[le]);
                free(cursor);
                return EPD_ERR_INTERNAL;
            }
            row = (int32_t)(plan->first_row[le] + cursor[le]++);
        }
        row_of[i] = row;
    }
    for (uint32_t e = 0; e < n_local; e++) {
        if (cursor[e] != plan->expert_rows[e]) {
            snprintf(err, EPD_ERR_LEN,
                     "external experts: expert %u has %u rows, the count exchange said %u",
                     plan->first_expert + e, cursor[e], plan->expert_rows[e]);
            free(cursor);
            return EPD_ERR_INTERNAL;
        }
    }
    free(cursor);
    return EPD_OK;
}

epd_status_t epd_external_gather_host(const epd_moe_shape_t *shape, const epd_external_plan_t *plan,
                                      void *x_out, float *scales_out, char err[EPD_ERR_LEN])
{
    epd_record_layout_t rec;
    uint32_t H = shape->hidden, K = shape->topk;
    bool fp8_wire = shape->dtype == EPD_WIRE_FP8;
    epd_scale_kind_t kind = epd_external_scale_kind(shape);
    uint32_t n_scales = epd_quant_n_scales(H, kind);
    size_t row_bytes = epd_external_row_bytes(shape, plan->input);
    size_t j = 0;
    /* one converted row, written to each row its record has (a record names up to K local
     * experts) */
    uint8_t *q = malloc(H);
    float *sc = malloc((size_t)n_scales * sizeof *sc);
    uint16_t *bf = malloc((size_t)H * 2);

    if (q == NULL || sc == NULL || bf == NULL) {
        free(q);
        free(sc);
        free(bf);
        snprintf(err, EPD_ERR_LEN, "external experts: out of host memory");
        return EPD_ERR_NO_MEMORY;
    }
    epd_record_layout(shape, &rec);
    for (uint32_t s = 0; s < plan->n_segments; s++) {
        const epd_external_segment_t *seg = &plan->segments[s];
        for (uint32_t r = 0; r < seg->count; r++, j++) {
            const uint8_t *in = (const uint8_t *)seg->records + (size_t)r * rec.size;
            bool made = false;
            for (uint32_t k = 0; k < K; k++) {
                int32_t row = plan->row_of[j * K + k];
                if (row < 0) continue;
                if (!made) {
                    /* the row as this format wants it, once per record */
                    if (fp8_wire) {
                        memcpy(q, in + rec.payload, H);
                        memcpy(sc, in + rec.scales, (size_t)n_scales * sizeof *sc);
                        if (plan->input == EPD_EXTERNAL_BF16)
                            epd_dequant_row_bf16_host(q, sc, H, kind, bf);
                    } else {
                        memcpy(bf, in + rec.payload, (size_t)H * 2);
                        if (plan->input != EPD_EXTERNAL_BF16)
                            epd_quant_row_host(bf, H, EPD_SCALE_GROUP128, shape->scale_format, q,
                                               sc);
                    }
                    made = true;
                }
                uint8_t *dst = (uint8_t *)x_out + (size_t)row * row_bytes;
                if (plan->input == EPD_EXTERNAL_BF16) {
                    memcpy(dst, bf, row_bytes);
                } else {
                    memcpy(dst, q, H);
                    memcpy(scales_out + (size_t)row * n_scales, sc, n_scales * sizeof *sc);
                }
            }
        }
    }
    free(q);
    free(sc);
    free(bf);
    return EPD_OK;
}

epd_status_t epd_external_partials_host(const epd_moe_shape_t *shape,
                                        const epd_external_plan_t *plan, const uint16_t *y,
                                        bool zero_only, char err[EPD_ERR_LEN])
{
    epd_record_layout_t rec;
    epd_partial_layout_t pl;
    uint32_t H = shape->hidden, K = shape->topk;
    float *acc = malloc((size_t)H * sizeof *acc);
    size_t j = 0;

    if (acc == NULL) {
        snprintf(err, EPD_ERR_LEN, "external experts: out of host memory");
        return EPD_ERR_NO_MEMORY;
    }
    epd_record_layout(shape, &rec);
    epd_partial_layout(shape, &pl);
    for (uint32_t s = 0; s < plan->n_segments; s++) {
        const epd_external_segment_t *seg = &plan->segments[s];
        for (uint32_t r = 0; r < seg->count; r++, j++) {
            const uint8_t *in = (const uint8_t *)seg->records + (size_t)r * rec.size;
            for (uint32_t i = 0; i < H; i++) acc[i] = 0.0f;
            for (uint32_t k = 0; k < K && !zero_only; k++) {
                int32_t row = plan->row_of[j * K + k];
                if (row < 0) continue;
                float w;
                memcpy(&w, in + rec.weights + (size_t)k * sizeof w, sizeof w);
                const uint16_t *yr = y + (size_t)row * H;
                for (uint32_t i = 0; i < H; i++) {
                    float wy = w * epd_bf16_to_f32(yr[i]);
                    acc[i] = acc[i] + wy;
                }
            }
            epd_partial_store_host(shape, acc, (uint8_t *)seg->partials + (size_t)r * pl.size,
                                   NULL);
        }
    }
    free(acc);
    return EPD_OK;
}
