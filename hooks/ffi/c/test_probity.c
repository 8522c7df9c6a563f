/* libprobity from C: decide (an allow; a deny with its obligations), read a sealed
 * object through the verified reader (sequentially and at random offsets), and a
 * tampered chunk that fails mid-read and blocks the node. Then the misuse C allows:
 * stale handles, NULL pointers, non-UTF-8 strings, double frees. Then, if asked,
 * loops of decides and verified reads (run under valgrind by the suite).
 *
 * usage: test_probity FIXTURE_DIR [DECIDES READS]
 * FIXTURE_DIR holds what tests/ffi/fixtures.rs seals: epoch-7.ckpt (+ .manifest),
 * tampered.ckpt (+ .manifest), state/ (with trusted.pub) and cluster.json. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "probity.h"

#define OBJECT_ID "llm/epoch-7"
#define CHUNK 65536
#define SIZE (4 * CHUNK + 1000)

static int passed, failed;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (cond) {                                                        \
            passed++;                                                      \
        } else {                                                           \
            failed++;                                                      \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, " (last error: %s)\n", probity_last_error());   \
        }                                                                  \
    } while (0)

static const char ALLOW[] =
    "{\"principal\": \"Workload::\\\"train-1\\\"\", \"action\": \"schedule\","
    " \"resource\": \"Node::\\\"gpu-a1\\\"\"}";
static const char HOT[] =
    "{\"principal\": \"Workload::\\\"train-1\\\"\", \"action\": \"schedule\","
    " \"resource\": \"Node::\\\"gpu-hot1\\\"\"}";

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        fclose(f);
        return NULL;
    }
    fclose(f);
    buf[n] = 0;
    *len = (size_t)n;
    return buf;
}

static char *path_in(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* Decides `request`; returns the decision JSON (caller frees with probity_free). */
static char *decide(probity_engine e, const char *request, uint32_t flags) {
    uint8_t *out = NULL;
    size_t len = 0;
    probity_status s = probity_decide(e, (const uint8_t *)request, strlen(request), flags, &out, &len);
    CHECK(s == PROBITY_STATUS_OK, "decide: status %d", s);
    CHECK(out == NULL || out[len] == 0, "the JSON is NUL-terminated");
    return (char *)out;
}

static probity_engine open_engine(const char *state_dir, const char *cluster) {
    probity_engine e = {0};
    probity_status s = probity_engine_open(NULL, state_dir, 0, &e);
    CHECK(s == PROBITY_STATUS_OK && e.id != 0, "open: status %d", s);
    size_t len = 0, count = 0;
    char *entities = read_file(cluster, &len);
    CHECK(entities != NULL, "read %s", cluster);
    s = probity_upsert_entities(e, (const uint8_t *)entities, len, &count);
    CHECK(s == PROBITY_STATUS_OK && count > 10, "upsert: status %d, %zu entities", s, count);
    free(entities);
    return e;
}

static void test_decide(probity_engine e) {
    char *d = decide(e, ALLOW, 0);
    CHECK(d && strstr(d, "\"decision\":\"allow\""), "allow: %s", d ? d : "(null)");
    probity_free((uint8_t *)d);

    d = decide(e, HOT, 0);
    CHECK(d && strstr(d, "\"decision\":\"deny\""), "deny: %s", d ? d : "(null)");
    CHECK(d && strstr(d, "\"kind\":\"migrate\"") && strstr(d, "Zone::\\\"zone-hot\\\""),
          "the deny carries its migrate obligation: %s", d ? d : "(null)");
    CHECK(d && strstr(d, "thermal.zone-power-ceiling"), "and its reason: %s", d ? d : "(null)");
    probity_free((uint8_t *)d);

    char batch[512];
    snprintf(batch, sizeof batch, "{\"requests\": [%s, %s]}", ALLOW, HOT);
    uint8_t *out = NULL;
    size_t len = 0;
    probity_status s = probity_decide_batch(e, (const uint8_t *)batch, strlen(batch), 0, &out, &len);
    CHECK(s == PROBITY_STATUS_OK && out, "batch: %d", s);
    const char *first = out ? strstr((char *)out, "\"decision\":\"allow\"") : NULL;
    const char *second = out ? strstr((char *)out, "\"decision\":\"deny\"") : NULL;
    CHECK(first && second && first < second, "batch answers in order: %s", out ? (char *)out : "(null)");
    probity_free(out);

    uint8_t *status = NULL;
    s = probity_engine_status(e, &status, &len);
    CHECK(s == PROBITY_STATUS_OK && strstr((char *)status, "\"digest\""), "status: %d", s);
    probity_free(status);
}

static void test_reader(probity_engine e, const char *dir) {
    char *object = path_in(dir, "epoch-7.ckpt");
    size_t len = 0;
    char *expected = read_file(object, &len);
    CHECK(expected && len == SIZE, "fixture size %zu", len);

    probity_reader r = {0};
    probity_status s = probity_reader_open(e, object, NULL, NULL, OBJECT_ID, "gpu-a1", &r);
    CHECK(s == PROBITY_STATUS_OK && r.id != 0, "reader_open: %d", s);
    uint64_t size = 0;
    CHECK(probity_reader_size(r, &size) == PROBITY_STATUS_OK && size == SIZE, "size %llu",
          (unsigned long long)size);

    /* Sequential reads in odd-sized pieces. */
    char *got = malloc(SIZE);
    size_t total = 0, n = 0;
    for (;;) {
        s = probity_reader_read(r, (uint8_t *)got + total, total + 9999 > SIZE ? SIZE - total : 9999, &n);
        CHECK(s == PROBITY_STATUS_OK, "read at %zu: %d", total, s);
        if (s != PROBITY_STATUS_OK || n == 0) break;
        total += n;
    }
    CHECK(total == SIZE && memcmp(got, expected, SIZE) == 0, "sequential read: %zu bytes", total);

    /* Random access: across a chunk boundary, and at the end. */
    uint8_t small[32];
    s = probity_reader_read_at(r, CHUNK - 16, small, sizeof small, &n);
    CHECK(s == PROBITY_STATUS_OK && n == 32 && memcmp(small, expected + CHUNK - 16, 32) == 0,
          "read_at across chunks: %d, %zu", s, n);
    s = probity_reader_read_at(r, SIZE - 10, small, sizeof small, &n);
    CHECK(s == PROBITY_STATUS_OK && n == 10, "read_at at the end: %d, %zu", s, n);
    uint64_t pos = 0;
    s = probity_reader_seek(r, 0, PROBITY_SEEK_CUR, &pos);
    CHECK(s == PROBITY_STATUS_OK && pos == SIZE, "read_at keeps the position: %llu", (unsigned long long)pos);
    s = probity_reader_seek(r, -100, PROBITY_SEEK_END, &pos);
    s = probity_reader_read(r, small, sizeof small, &n);
    CHECK(s == PROBITY_STATUS_OK && n == 32 && memcmp(small, expected + SIZE - 100, 32) == 0, "seek from the end");
    CHECK(probity_reader_close(r) == PROBITY_STATUS_OK, "close");
    CHECK(probity_reader_close(r) == PROBITY_STATUS_STALE_HANDLE, "double close is refused");
    CHECK(probity_reader_read(r, small, 1, &n) == PROBITY_STATUS_STALE_HANDLE, "a closed reader is stale");

    /* The tampered copy: the chunks before the flipped byte read, chunk 2 fails. */
    char *tampered = path_in(dir, "tampered.ckpt");
    s = probity_reader_open(e, tampered, NULL, NULL, OBJECT_ID, "gpu-a1", &r);
    CHECK(s == PROBITY_STATUS_OK, "tampered reader_open (the manifest and size are fine): %d", s);
    total = 0;
    for (;;) {
        s = probity_reader_read(r, (uint8_t *)got + total, 4096, &n);
        total += n;
        if (s != PROBITY_STATUS_OK || n == 0) break;
    }
    CHECK(s == PROBITY_STATUS_INTEGRITY_FAILURE, "the tampered chunk fails: %d", s);
    CHECK(total == 2 * CHUNK && memcmp(got, expected, total) == 0,
          "every byte before chunk 2 was handed out, none of it: %zu", total);
    CHECK(strstr(probity_last_error(), "chunk 2") != NULL, "the error names the chunk");
    s = probity_reader_read_at(r, 0, small, 4, &n);
    CHECK(s == PROBITY_STATUS_INTEGRITY_FAILURE && n == 0, "a failed reader refuses every read");
    probity_reader_close(r);

    /* The node is blocked: scheduling onto it is denied, and it may not read. */
    char *d = decide(e, ALLOW, 0);
    CHECK(d && strstr(d, "security.blocked-node"), "gpu-a1 is blocked: %s", d ? d : "(null)");
    probity_free((uint8_t *)d);
    r.id = 0;
    s = probity_reader_open(e, object, NULL, NULL, OBJECT_ID, "gpu-a1", &r);
    CHECK(s == PROBITY_STATUS_DENIED && r.id == 0, "a blocked node gets no reader: %d", s);

    /* Whole-object verification as another node. */
    uint8_t *report = NULL;
    s = probity_verify(e, object, NULL, OBJECT_ID, NULL, "gpu-h1", &report, &len);
    CHECK(s == PROBITY_STATUS_OK && report && strstr((char *)report, "\"verified\":true"),
          "verify: %d %s", s, report ? (char *)report : "(null)");
    probity_free(report);

    free(got);
    free(expected);
    free(object);
    free(tampered);
}

static void test_misuse(const char *dir) {
    probity_engine e = {0};
    CHECK(probity_engine_open(NULL, NULL, 0, &e) == PROBITY_STATUS_OK, "open");
    CHECK(probity_engine_close(e) == PROBITY_STATUS_OK, "close");
    uint8_t *out = (uint8_t *)1;
    size_t len = 7;
    probity_status s = probity_decide(e, (const uint8_t *)ALLOW, strlen(ALLOW), 0, &out, &len);
    CHECK(s == PROBITY_STATUS_STALE_HANDLE && out == NULL && len == 0, "closed engine: %d", s);
    CHECK(probity_engine_close(e) == PROBITY_STATUS_STALE_HANDLE, "double close");
    probity_engine zero = {0};
    CHECK(probity_engine_close(zero) == PROBITY_STATUS_STALE_HANDLE, "null handle");
    probity_engine made_up = {0x0100000100000001ull};
    CHECK(probity_engine_close(made_up) == PROBITY_STATUS_STALE_HANDLE, "made-up handle");

    CHECK(probity_engine_open(NULL, NULL, 0, &e) == PROBITY_STATUS_OK, "open");
    probity_reader as_reader = {e.id};
    CHECK(probity_reader_close(as_reader) == PROBITY_STATUS_STALE_HANDLE, "an engine is not a reader");
    s = probity_decide(e, NULL, 10, 0, &out, &len);
    CHECK(s == PROBITY_STATUS_NULL_POINTER, "NULL request: %d", s);
    s = probity_decide(e, (const uint8_t *)ALLOW, strlen(ALLOW), 0, NULL, &len);
    CHECK(s == PROBITY_STATUS_NULL_POINTER, "NULL out: %d", s);
    const char bad[] = "{\"principal\": \"\xff\"}";
    s = probity_decide(e, (const uint8_t *)bad, strlen(bad), 0, &out, &len);
    CHECK(s == PROBITY_STATUS_NOT_UTF8, "non-UTF-8 request: %d", s);
    s = probity_decide(e, (const uint8_t *)"{", 1, 0, &out, &len);
    CHECK(s == PROBITY_STATUS_INVALID_ARGUMENT && strstr(probity_last_error(), "line 1"),
          "malformed request: %d", s);
    s = probity_decide(e, (const uint8_t *)ALLOW, strlen(ALLOW), 0x40, &out, &len);
    CHECK(s == PROBITY_STATUS_INVALID_ARGUMENT, "unknown flags: %d", s);
    probity_engine bad_open = {0};
    s = probity_engine_open("/tmp/\xfe", NULL, 0, &bad_open);
    CHECK(s == PROBITY_STATUS_NOT_UTF8 && bad_open.id == 0, "non-UTF-8 path: %d", s);
    char *object = path_in(dir, "epoch-7.ckpt");
    probity_reader r = {0};
    s = probity_reader_open(e, object, NULL, NULL, OBJECT_ID, NULL, &r);
    CHECK(s == PROBITY_STATUS_INVALID_ARGUMENT, "verification needs a state directory: %d", s);
    free(object);

    char *d = decide(e, ALLOW, PROBITY_DECIDE_DRY_RUN);
    CHECK(probity_free((uint8_t *)d) == PROBITY_STATUS_OK, "free");
    CHECK(probity_free((uint8_t *)d) == PROBITY_STATUS_STALE_HANDLE, "double free is refused");
    char mine[4];
    CHECK(probity_free((uint8_t *)mine) == PROBITY_STATUS_STALE_HANDLE, "a foreign pointer is refused");
    CHECK(probity_free(NULL) == PROBITY_STATUS_OK, "free(NULL)");
    probity_engine_close(e);
}

/* `decides` decisions, then `reads` verified reads at offsets that change chunk each time. */
static void loops(const char *dir, long decides, long reads) {
    char *cluster = path_in(dir, "cluster.json");
    char *state = path_in(dir, "state");
    char *object = path_in(dir, "epoch-7.ckpt");
    size_t len = 0;
    char *expected = read_file(object, &len);

    probity_engine plain = open_engine(NULL, cluster);
    long allows = 0;
    for (long i = 0; i < decides; i++) {
        char *d = decide(plain, (i & 1) ? HOT : ALLOW, 0);
        allows += d && strstr(d, "\"decision\":\"allow\"") ? 1 : 0;
        probity_free((uint8_t *)d);
    }
    CHECK(allows == (decides + 1) / 2, "%ld allows in %ld decisions", allows, decides);
    probity_engine_close(plain);

    probity_engine e = {0};
    CHECK(probity_engine_open(NULL, state, 0, &e) == PROBITY_STATUS_OK, "open with state");
    probity_reader r = {0};
    uint8_t buf[4096];
    long good = 0;
    for (long i = 0; i < reads; i++) {
        if (i % 1000 == 0) {
            if (r.id) probity_reader_close(r);
            probity_status s = probity_reader_open(e, object, NULL, NULL, OBJECT_ID, NULL, &r);
            CHECK(s == PROBITY_STATUS_OK, "reader_open %ld: %d", i, s);
        }
        uint64_t offset = ((uint64_t)(i % 5) * CHUNK + (uint64_t)i * 7) % (SIZE - sizeof buf);
        size_t n = 0;
        probity_status s = probity_reader_read_at(r, offset, buf, sizeof buf, &n);
        good += s == PROBITY_STATUS_OK && n == sizeof buf && memcmp(buf, expected + offset, n) == 0;
    }
    if (r.id) probity_reader_close(r);
    CHECK(good == reads, "%ld of %ld verified reads returned the right bytes", good, reads);
    probity_engine_close(e);
    free(expected);
    free(cluster);
    free(state);
    free(object);
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 4) {
        fprintf(stderr, "usage: %s FIXTURE_DIR [DECIDES READS]\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    CHECK(strcmp(probity_version(), "") != 0, "version");
    CHECK(probity_abi_version() == PROBITY_ABI_VERSION, "ABI %u", probity_abi_version());

    char *cluster = path_in(dir, "cluster.json");
    char *state = path_in(dir, "state");
    probity_engine e = open_engine(state, cluster);
    test_decide(e);
    test_reader(e, dir);
    probity_engine_close(e);
    test_misuse(dir);
    free(cluster);
    free(state);
    if (argc == 4) loops(dir, atol(argv[2]), atol(argv[3]));

    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
