/* The launch geometries kbench --sweep times for the layout-aware requant, shared with test_quant
 * (which checks every one of them bit for bit against the host), and their parser.
 * A geometry is T:V:R:B[:S[:F]] (epd_quant_launch_t): T threads a block, V 16-byte vectors a
 * thread a pass, R rows a tile (the launch carries one word a tile), B blocks an SM at most (0: as
 * many as fit), S parts a tile (a block's item: ceil(R / S) rows; 0 or 1: the tile), F variant
 * bits: 1 pipelined passes, 2 read-only loads without L1 allocation, 4 streaming stores, 8 a
 * balanced grid, 16 the stream kernel (EPD_QL_*; R is then the least passes a block), 32 the
 * grid kernel (R then only the step reduction's tile rows). F with 32 runs the grid kernel, with
 * 16 the stream kernel, else any S > 1 or F != 0 the part kernel. */
#ifndef EPD_TESTS_GPU_QUANT_SWEEP_H
#define EPD_TESTS_GPU_QUANT_SWEEP_H

#include <stdio.h>
#include <string.h>

#include <string>
#include <utility>
#include <vector>

#include "gpu/quant.h"

/* At H 7168 a row is 448 vectors: 448 x 1 and 224 x 2 are a row a pass, 224 x 4 and 448 x 2 two
 * rows, 448 x 4 four. The first group is the tile kernel (the picks before the part kernel and
 * their neighbours); then parts of 1, 2 and 4 rows cut from 8- to 64-row tiles (tables 4 to 32
 * times smaller than a tile a block), each with and without the pipelined passes and the
 * balanced grid; then the cache hints and the blocks an SM on the 2-row parts; then the stream
 * kernel (a contiguous chunk of the live vectors a block, all blocks resident at once): 1, 2 and
 * 4 vectors a thread, with and without the pipelined passes, 1 or 2 passes a block at least,
 * blocks an SM, the cache hints; then the grid kernel (the copy kernel's shape over the live
 * vectors): 1, 2 and 4 vectors a thread, 128 to 448 threads, 2 to 8 blocks an SM or as many as
 * fit, streaming stores and read-only loads. */
#define EPD_REQUANT_SWEEP                                                                         \
    "448:1:1:4,224:4:2:4,224:2:8:4,224:2:1:4,224:2:2:4,224:2:4:4,224:4:4:4,224:4:8:4,"           \
    "448:4:4:4,448:2:2:4,224:4:2:8,224:2:16:4,"                                                   \
    "224:2:8:4:0:1,224:2:8:4:0:8,224:2:8:4:0:9,224:2:2:4:0:9,224:4:2:4:0:9,448:1:1:4:0:9,"       \
    "448:1:8:4:8:0,448:1:8:4:8:8,448:1:8:4:8:9,224:2:8:4:8:9,"                                    \
    "224:4:8:4:4:0,224:4:8:4:4:8,224:4:8:4:4:9,448:2:8:4:4:8,448:4:16:4:4:8,448:4:16:4:4:9,"      \
    "224:4:32:4:16:8,224:4:32:4:16:9,224:4:32:4:8:9,224:4:64:4:32:9,"                            \
    "224:2:16:4:8:9,224:2:32:4:16:8,224:2:32:4:16:9,224:2:32:4:8:9,224:2:64:4:32:9,"             \
    "448:2:32:4:16:9,"                                                                            \
    "224:4:8:4:4:10,224:4:8:4:4:12,224:2:32:4:16:11,224:2:32:4:16:13,224:2:32:4:16:15,"          \
    "224:2:32:6:16:9,224:2:32:8:16:9,224:2:32:0:16:9,224:4:32:0:16:9,"                           \
    "224:4:1:4:0:16,224:2:1:4:0:16,448:1:1:4:0:16,448:2:1:4:0:16,"                               \
    "224:4:1:4:0:17,224:2:1:4:0:17,448:2:1:4:0:17,448:4:1:2:0:17,224:4:2:4:0:17,"               \
    "224:2:2:4:0:17,224:4:1:0:0:17,224:4:1:3:0:17,128:4:1:8:0:17,256:4:1:4:0:17,"               \
    "224:4:1:4:0:21,224:4:1:4:0:19,"                                                              \
    "224:1:8:8:0:32,448:1:8:4:0:32,224:2:8:4:0:32,224:2:8:8:0:32,448:2:8:4:0:32,224:4:8:4:0:32,"  \
    "224:4:8:2:0:32,448:4:8:2:0:32,256:2:8:4:0:32,128:2:8:8:0:32,224:2:8:6:0:32,224:1:8:0:0:32,"  \
    "224:2:8:4:0:36,224:1:8:8:0:36,224:2:8:4:0:34,448:1:8:4:0:36"

/* "a:b:c[:d[:e[:f]]],..." into launch parameters; with_kind: each item starts "group:" or
 * "token:" (the quantize kernels), kind 0 or 1 in .first. false on a malformed item. */
static inline bool epd_parse_geoms(const char *s, bool with_kind,
                                   std::vector<std::pair<int, epd_quant_launch_t>> *out)
{
    std::string all(s);
    size_t pos = 0;
    while (pos <= all.size()) {
        size_t end = all.find(',', pos);
        if (end == std::string::npos) end = all.size();
        std::string item = all.substr(pos, end - pos);
        pos = end + 1;
        if (item.empty()) continue;
        int kind = 0;
        if (with_kind) {
            if (item.rfind("group:", 0) == 0) kind = 0;
            else if (item.rfind("token:", 0) == 0) kind = 1;
            else return false;
            item = item.substr(6);
        }
        unsigned v[6] = {0, 0, 0, 0, 0, 0};
        char tail = 0;
        int n = sscanf(item.c_str(), "%u:%u:%u:%u:%u:%u%c", &v[0], &v[1], &v[2], &v[3], &v[4],
                       &v[5], &tail);
        if (n < 3 || n > 6) return false;
        epd_quant_launch_t l = {v[0], v[1], v[2], v[3], v[4], v[5]};
        out->push_back({kind, l});
    }
    return true;
}

/* T:V:R:B, and :S:F when either is set (the tile kernel's geometries keep their old names). */
static inline std::string epd_geom_str(const epd_quant_launch_t &l)
{
    char b[96];
    if (l.split > 1 || l.flags != 0)
        snprintf(b, sizeof b, "%u:%u:%u:%u:%u:%u", l.threads, l.vec, l.rows, l.blocks, l.split,
                 l.flags);
    else
        snprintf(b, sizeof b, "%u:%u:%u:%u", l.threads, l.vec, l.rows, l.blocks);
    return b;
}

#endif
