/*
 * fake_nvml.c - a fake libnvidia-ml.so.1 for tests on machines without a GPU.
 *
 * It is compiled against the REAL nvml.h (PyPI nvidia-nvml-dev) and is loaded by the REAL Python
 * bindings (nvidia-ml-py, module pynvml). Its behaviour is driven by a small text file named by
 * KAI_FAKE_NVML_CONFIG; see README.md next to this file for the format, the state file and the
 * call log. Build: scripts/test-tools.sh (-DFAKE_NVML_OLD_DRIVER drops the r615 memory-limit
 * symbols, which is how a driver older than r615 looks to the bindings).
 *
 * Every exported call holds one process-wide mutex; the state file and the log are appended
 * with O_APPEND under flock(), so several processes may share them.
 */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FAKE_MAX_GPUS 64
#define FAKE_MAX_PROCS 256
#define FAKE_MAX_ERRORS 64
#define FAKE_MAX_CONFIG (256 * 1024)
#define FAKE_MAX_NAMESPACE 1023 /* bytes of a cgroup path we accept (longer: INVALID_ARGUMENT) */
#define FAKE_ID_LEN 128
#define FAKE_FN_LEN 96

struct nvmlDevice_st {
    unsigned int index;
};

typedef struct {
    unsigned int index;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned long long total;
    unsigned long long reserved;
    int compute_mode;
    int mig;
    int lost;
    int util_gpu; /* -1: derived from the processes' sm utilisation */
    int util_memory;
} fake_gpu;

typedef struct {
    unsigned int gpu;
    unsigned int pid;
    unsigned long long used; /* NVML_VALUE_NOT_AVAILABLE when "used=na" */
    int has_sm;
    unsigned int sm;
    unsigned int mem;
    char cgroup[FAKE_MAX_NAMESPACE + 1];
} fake_proc;

typedef struct {
    char function[FAKE_FN_LEN];
    nvmlReturn_t code;
    long times; /* -1: forever */
    char id[FAKE_ID_LEN];
} fake_error;

typedef struct {
    int present; /* the config file exists and was read */
    int valid;   /* it parsed without errors */
    char driver[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    int has_init_error;
    nvmlReturn_t init_error;
    int trace;
    int check_cgroups; /* a namespace must be an existing directory (else OPERATING_SYSTEM) */
    unsigned int gpu_count;
    fake_gpu gpus[FAKE_MAX_GPUS];
    unsigned int proc_count;
    fake_proc procs[FAKE_MAX_PROCS];
    unsigned int error_count;
    fake_error errors[FAKE_MAX_ERRORS];
} fake_config;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int g_init_count;
static struct nvmlDevice_st g_handles[FAKE_MAX_GPUS];
static fake_config g_cfg;
static char g_raw[FAKE_MAX_CONFIG + 1];      /* the config text g_cfg was parsed from */
static size_t g_raw_len = (size_t)-1;        /* (size_t)-1: nothing cached */
static char g_buf[FAKE_MAX_CONFIG + 2];      /* scratch for reading the config */
static char g_cfg_path[4096];

/* ------------------------------------------------------------------------------------------ */
/* paths                                                                                      */

static const char *config_path(void) {
    const char *p = getenv("KAI_FAKE_NVML_CONFIG");
    return (p != NULL && p[0] != '\0') ? p : NULL;
}

/* env override, else "<config><suffix>"; NULL when neither is available */
static const char *derived_path(const char *env, const char *suffix, char *out, size_t n) {
    const char *p = getenv(env);
    if (p != NULL && p[0] != '\0') {
        return p;
    }
    const char *cfg = config_path();
    if (cfg == NULL) {
        return NULL;
    }
    int w = snprintf(out, n, "%s%s", cfg, suffix);
    return (w > 0 && (size_t)w < n) ? out : NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* config parsing                                                                             */

static void config_error(const char *path, unsigned int line, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fake_nvml: %s:%u: %s\n", path, line, msg);
    g_cfg.valid = 0;
}

static int parse_ull(const char *s, unsigned long long *out) {
    if (s == NULL || *s == '\0' || *s == '-') {
        return 0;
    }
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno != 0 || end == s || *end != '\0') {
        return 0;
    }
    *out = v;
    return 1;
}

static int parse_uint(const char *s, unsigned int max, unsigned int *out) {
    unsigned long long v;
    if (!parse_ull(s, &v) || v > max) {
        return 0;
    }
    *out = (unsigned int)v;
    return 1;
}

static int parse_code(const char *s, nvmlReturn_t *out) {
    unsigned int v;
    if (!parse_uint(s, 100000, &v)) {
        return 0;
    }
    *out = (nvmlReturn_t)v;
    return 1;
}

static int copy_str(char *dst, size_t n, const char *src) {
    size_t len = strlen(src);
    if (len + 1 > n) {
        return 0;
    }
    memcpy(dst, src, len + 1);
    return 1;
}

static char *next_token(char **cursor) {
    char *s = *cursor;
    while (*s == ' ' || *s == '\t') {
        s++;
    }
    if (*s == '\0') {
        *cursor = s;
        return NULL;
    }
    char *start = s;
    while (*s != '\0' && *s != ' ' && *s != '\t') {
        s++;
    }
    if (*s != '\0') {
        *s++ = '\0';
    }
    *cursor = s;
    return start;
}

static void rtrim(char *s) {
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r')) {
        s[--n] = '\0';
    }
}

static void parse_gpu(const char *path, unsigned int ln, char *rest) {
    if (g_cfg.gpu_count >= FAKE_MAX_GPUS) {
        config_error(path, ln, "more than %d gpus", FAKE_MAX_GPUS);
        return;
    }
    fake_gpu *g = &g_cfg.gpus[g_cfg.gpu_count];
    memset(g, 0, sizeof *g);
    g->index = g_cfg.gpu_count;
    g->util_gpu = -1;
    copy_str(g->name, sizeof g->name, "NVIDIA Fake GPU");
    int has_uuid = 0, has_memory = 0;
    char *tok;
    while ((tok = next_token(&rest)) != NULL) {
        char *eq = strchr(tok, '=');
        if (eq == NULL) {
            config_error(path, ln, "gpu: expected key=value, got '%s'", tok);
            return;
        }
        *eq = '\0';
        const char *key = tok;
        char *val = eq + 1;
        unsigned int u = 0;
        int ok = 1;
        if (strcmp(key, "name") == 0) {
            /* the name is the rest of the line (it may contain spaces) */
            if (*rest != '\0') {
                val[strlen(val)] = ' ';
            }
            rtrim(val);
            ok = copy_str(g->name, sizeof g->name, val);
            rest += strlen(rest);
        } else if (strcmp(key, "index") == 0) {
            ok = parse_uint(val, FAKE_MAX_GPUS - 1, &g->index);
        } else if (strcmp(key, "uuid") == 0) {
            ok = copy_str(g->uuid, sizeof g->uuid, val) && val[0] != '\0';
            has_uuid = 1;
        } else if (strcmp(key, "memory") == 0) {
            ok = parse_ull(val, &g->total);
            has_memory = 1;
        } else if (strcmp(key, "reserved") == 0) {
            ok = parse_ull(val, &g->reserved);
        } else if (strcmp(key, "compute_mode") == 0) {
            ok = parse_uint(val, NVML_COMPUTEMODE_COUNT - 1, &u);
            g->compute_mode = (int)u;
        } else if (strcmp(key, "mig") == 0) {
            ok = parse_uint(val, 1, &u);
            g->mig = (int)u;
        } else if (strcmp(key, "lost") == 0) {
            ok = parse_uint(val, 1, &u);
            g->lost = (int)u;
        } else if (strcmp(key, "util_gpu") == 0) {
            ok = parse_uint(val, 100, &u);
            g->util_gpu = (int)u;
        } else if (strcmp(key, "util_memory") == 0) {
            ok = parse_uint(val, 100, &u);
            g->util_memory = (int)u;
        } else {
            config_error(path, ln, "gpu: unknown key '%s'", key);
            return;
        }
        if (!ok) {
            config_error(path, ln, "gpu: bad value for '%s': '%s'", key, val);
            return;
        }
    }
    if (!has_uuid || !has_memory) {
        config_error(path, ln, "gpu: uuid= and memory= are required");
        return;
    }
    g_cfg.gpu_count++;
}

static void parse_process(const char *path, unsigned int ln, char *rest) {
    if (g_cfg.proc_count >= FAKE_MAX_PROCS) {
        config_error(path, ln, "more than %d processes", FAKE_MAX_PROCS);
        return;
    }
    fake_proc *p = &g_cfg.procs[g_cfg.proc_count];
    memset(p, 0, sizeof *p);
    int has_gpu = 0, has_pid = 0, has_used = 0;
    char *tok;
    while ((tok = next_token(&rest)) != NULL) {
        char *eq = strchr(tok, '=');
        if (eq == NULL) {
            config_error(path, ln, "process: expected key=value, got '%s'", tok);
            return;
        }
        *eq = '\0';
        const char *key = tok;
        const char *val = eq + 1;
        int ok = 1;
        if (strcmp(key, "gpu") == 0) {
            ok = parse_uint(val, FAKE_MAX_GPUS - 1, &p->gpu);
            has_gpu = 1;
        } else if (strcmp(key, "pid") == 0) {
            ok = parse_uint(val, 0xFFFFFFFFu, &p->pid);
            has_pid = 1;
        } else if (strcmp(key, "used") == 0) {
            if (strcmp(val, "na") == 0) {
                p->used = (unsigned long long)NVML_VALUE_NOT_AVAILABLE;
            } else {
                ok = parse_ull(val, &p->used);
            }
            has_used = 1;
        } else if (strcmp(key, "sm") == 0) {
            ok = parse_uint(val, 100, &p->sm);
            p->has_sm = 1;
        } else if (strcmp(key, "mem") == 0) {
            ok = parse_uint(val, 100, &p->mem);
        } else if (strcmp(key, "cgroup") == 0) {
            ok = copy_str(p->cgroup, sizeof p->cgroup, val);
        } else {
            config_error(path, ln, "process: unknown key '%s'", key);
            return;
        }
        if (!ok) {
            config_error(path, ln, "process: bad value for '%s': '%s'", key, val);
            return;
        }
    }
    if (!has_gpu || !has_pid || !has_used) {
        config_error(path, ln, "process: gpu=, pid= and used= are required");
        return;
    }
    g_cfg.proc_count++;
}

static void parse_error_line(const char *path, unsigned int ln, char *rest) {
    if (g_cfg.error_count >= FAKE_MAX_ERRORS) {
        config_error(path, ln, "more than %d error lines", FAKE_MAX_ERRORS);
        return;
    }
    fake_error *e = &g_cfg.errors[g_cfg.error_count];
    memset(e, 0, sizeof *e);
    e->times = -1;
    char *fn = next_token(&rest);
    char *code = next_token(&rest);
    if (fn == NULL || code == NULL || !copy_str(e->function, sizeof e->function, fn) ||
        !parse_code(code, &e->code)) {
        config_error(path, ln, "usage: error <nvmlFunction> <nvmlReturn_t> [times=N] [id=X]");
        return;
    }
    snprintf(e->id, sizeof e->id, "%s@%u", fn, ln);
    char *tok;
    while ((tok = next_token(&rest)) != NULL) {
        unsigned long long v;
        if (strncmp(tok, "times=", 6) == 0 && parse_ull(tok + 6, &v) && v > 0 && v < 1000000) {
            e->times = (long)v;
        } else if (strncmp(tok, "id=", 3) == 0 && tok[3] != '\0' &&
                   copy_str(e->id, sizeof e->id, tok + 3)) {
            /* done */
        } else if (parse_ull(tok, &v) && v > 0 && v < 1000000) {
            e->times = (long)v; /* a bare count is accepted too */
        } else {
            config_error(path, ln, "error: bad option '%s'", tok);
            return;
        }
    }
    g_cfg.error_count++;
}

static void parse_config(const char *path, char *text) {
    memset(&g_cfg, 0, sizeof g_cfg);
    g_cfg.present = 1;
    g_cfg.valid = 1;
    copy_str(g_cfg.driver, sizeof g_cfg.driver, "615.00.00");
    unsigned int ln = 0;
    char *line = text; /* split by hand: strtok would merge empty lines and shift line numbers */
    while (line != NULL && g_cfg.valid) {
        char *nl = strchr(line, '\n');
        if (nl != NULL) {
            *nl = '\0';
        }
        ln++;
        rtrim(line);
        char *rest = line;
        char *word = next_token(&rest);
        if (word == NULL || word[0] == '#') {
            /* blank or comment */
        } else if (strcmp(word, "driver_version") == 0) {
            char *v = next_token(&rest);
            if (v == NULL || next_token(&rest) != NULL ||
                !copy_str(g_cfg.driver, sizeof g_cfg.driver, v)) {
                config_error(path, ln, "usage: driver_version <version>");
            }
        } else if (strcmp(word, "gpu") == 0) {
            parse_gpu(path, ln, rest);
        } else if (strcmp(word, "process") == 0) {
            parse_process(path, ln, rest);
        } else if (strcmp(word, "error") == 0) {
            parse_error_line(path, ln, rest);
        } else if (strcmp(word, "init_error") == 0) {
            char *v = next_token(&rest);
            if (v == NULL || next_token(&rest) != NULL || !parse_code(v, &g_cfg.init_error)) {
                config_error(path, ln, "usage: init_error <nvmlReturn_t>");
            }
            g_cfg.has_init_error = 1;
        } else if (strcmp(word, "trace") == 0) {
            char *v = next_token(&rest);
            unsigned int t;
            if (v == NULL || !parse_uint(v, 1, &t)) {
                config_error(path, ln, "usage: trace 0|1");
            }
            g_cfg.trace = (v != NULL && strcmp(v, "1") == 0);
        } else if (strcmp(word, "check_cgroups") == 0) {
            char *v = next_token(&rest);
            unsigned int t;
            if (v == NULL || next_token(&rest) != NULL || !parse_uint(v, 1, &t)) {
                config_error(path, ln, "usage: check_cgroups 0|1");
            }
            g_cfg.check_cgroups = (v != NULL && strcmp(v, "1") == 0);
        } else {
            config_error(path, ln, "unknown directive '%s'", word);
        }
        line = (nl != NULL) ? nl + 1 : NULL;
    }
    if (!g_cfg.valid) {
        return;
    }
    /* indexes must be 0..n-1, each once; uuids unique; processes on existing gpus */
    unsigned char seen[FAKE_MAX_GPUS] = {0};
    for (unsigned int i = 0; i < g_cfg.gpu_count; i++) {
        unsigned int idx = g_cfg.gpus[i].index;
        if (idx >= g_cfg.gpu_count || seen[idx]) {
            config_error(path, 0, "gpu indexes must be 0..%u, each once (bad: %u)",
                         g_cfg.gpu_count - 1, idx);
            return;
        }
        seen[idx] = 1;
        for (unsigned int j = 0; j < i; j++) {
            if (strcmp(g_cfg.gpus[i].uuid, g_cfg.gpus[j].uuid) == 0) {
                config_error(path, 0, "duplicate gpu uuid %s", g_cfg.gpus[i].uuid);
                return;
            }
        }
    }
    /* order the table by index so that index == position */
    for (unsigned int i = 0; i < g_cfg.gpu_count; i++) {
        while (g_cfg.gpus[i].index != i) {
            fake_gpu tmp = g_cfg.gpus[g_cfg.gpus[i].index];
            g_cfg.gpus[g_cfg.gpus[i].index] = g_cfg.gpus[i];
            g_cfg.gpus[i] = tmp;
        }
    }
    for (unsigned int i = 0; i < g_cfg.proc_count; i++) {
        if (g_cfg.procs[i].gpu >= g_cfg.gpu_count) {
            config_error(path, 0, "process pid=%u is on gpu=%u, which does not exist",
                         g_cfg.procs[i].pid, g_cfg.procs[i].gpu);
            return;
        }
    }
}

/* Reads the config on every call; re-parses only when its bytes changed. */
static void reload_config(void) {
    const char *path = config_path();
    FILE *f = (path != NULL) ? fopen(path, "re") : NULL;
    if (f == NULL) {
        memset(&g_cfg, 0, sizeof g_cfg);
        g_raw_len = (size_t)-1;
        return;
    }
    size_t n = fread(g_buf, 1, FAKE_MAX_CONFIG + 1, f);
    int failed = ferror(f);
    fclose(f);
    if (failed || n > FAKE_MAX_CONFIG) {
        memset(&g_cfg, 0, sizeof g_cfg);
        g_cfg.present = 1;
        g_raw_len = (size_t)-1;
        fprintf(stderr, "fake_nvml: %s: unreadable or larger than %d bytes\n", path,
                FAKE_MAX_CONFIG);
        return;
    }
    g_buf[n] = '\0';
    if (n == g_raw_len && strcmp(path, g_cfg_path) == 0 && memcmp(g_buf, g_raw, n) == 0) {
        return;
    }
    memcpy(g_raw, g_buf, n + 1);
    g_raw_len = n;
    copy_str(g_cfg_path, sizeof g_cfg_path, path);
    parse_config(path, g_buf); /* parses g_buf in place; g_raw keeps the pristine bytes */
}

/* ------------------------------------------------------------------------------------------ */
/* state file and log                                                                         */

/* percent-escapes bytes <= 0x20, 0x7f and '%' so that a field never contains whitespace */
__attribute__((unused)) static void escape_field(const char *in, char *out, size_t n) {
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)in; *p != '\0'; p++) {
        if (*p <= 0x20 || *p == 0x7f || *p == '%') {
            if (o + 4 > n) {
                break;
            }
            out[o++] = '%';
            out[o++] = hex[*p >> 4];
            out[o++] = hex[*p & 15];
        } else {
            if (o + 2 > n) {
                break;
            }
            out[o++] = (char)*p;
        }
    }
    out[o] = '\0';
}

static void append_line(const char *path, const char *line) {
    if (path == NULL) {
        return;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "fake_nvml: cannot append to %s: %s\n", path, strerror(errno));
        return;
    }
    flock(fd, LOCK_EX);
    size_t len = strlen(line), off = 0;
    while (off < len) {
        ssize_t w = write(fd, line + off, len - off);
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            fprintf(stderr, "fake_nvml: write to %s failed: %s\n", path, strerror(errno));
            break;
        }
        off += (size_t)w;
    }
    flock(fd, LOCK_UN);
    close(fd);
}

static void state_append(const char *line) {
    char buf[4096];
    append_line(derived_path("KAI_FAKE_NVML_STATE", ".state", buf, sizeof buf), line);
}

static void log_append(const char *line) {
    char buf[4096];
    append_line(derived_path("KAI_FAKE_NVML_LOG", ".log", buf, sizeof buf), line);
}

typedef struct {
    /* query */
    const char *kind;   /* "limit", "limit_cgroup", "compute_mode" or "error_hit" */
    const char *key1;   /* uuid / error id */
    const char *key2;   /* escaped namespace (limit and limit_cgroup only) */
    /* results */
    int found;
    long count;
    unsigned long long v1, v2;
    char text[FAKE_ID_LEN]; /* limit_cgroup: the directory's identity */
} state_query;

/* Scans the append-only state file; the last matching record wins. */
static void state_scan(state_query *q) {
    char pbuf[4096];
    const char *path = derived_path("KAI_FAKE_NVML_STATE", ".state", pbuf, sizeof pbuf);
    q->found = 0;
    q->count = 0;
    if (path == NULL) {
        return;
    }
    FILE *f = fopen(path, "re");
    if (f == NULL) {
        return;
    }
    flock(fileno(f), LOCK_SH);
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) >= 0) {
        char *rest = line;
        line[strcspn(line, "\n")] = '\0';
        char *kind = next_token(&rest);
        char *k1 = next_token(&rest);
        if (kind == NULL || k1 == NULL || strcmp(kind, q->kind) != 0 || strcmp(k1, q->key1) != 0) {
            continue;
        }
        if (strcmp(kind, "error_hit") == 0) {
            q->count++;
            q->found = 1;
        } else if (strcmp(kind, "compute_mode") == 0) {
            unsigned long long m;
            char *v = next_token(&rest);
            if (v != NULL && parse_ull(v, &m)) {
                q->v1 = m;
                q->found = 1;
            }
        } else if (strcmp(kind, "limit") == 0) {
            char *ns = next_token(&rest);
            char *soft = next_token(&rest);
            char *hard = next_token(&rest);
            unsigned long long s, h;
            if (ns != NULL && q->key2 != NULL && strcmp(ns, q->key2) == 0 && soft != NULL &&
                hard != NULL && parse_ull(soft, &s) && parse_ull(hard, &h)) {
                q->v1 = s;
                q->v2 = h;
                q->found = 1;
            }
        } else if (strcmp(kind, "limit_cgroup") == 0) {
            char *ns = next_token(&rest);
            char *id = next_token(&rest);
            if (ns != NULL && q->key2 != NULL && strcmp(ns, q->key2) == 0 && id != NULL &&
                copy_str(q->text, sizeof q->text, id)) {
                q->found = 1;
            }
        }
    }
    free(line);
    flock(fileno(f), LOCK_UN);
    fclose(f);
}

/* ------------------------------------------------------------------------------------------ */
/* call frame                                                                                 */

static nvmlReturn_t injected_error(const char *fn) {
    for (unsigned int i = 0; i < g_cfg.error_count; i++) {
        fake_error *e = &g_cfg.errors[i];
        if (strcmp(e->function, fn) != 0) {
            continue;
        }
        if (e->times < 0) {
            return e->code;
        }
        state_query q = {.kind = "error_hit", .key1 = e->id};
        state_scan(&q);
        if (q.count < e->times) {
            char line[FAKE_ID_LEN + 32];
            snprintf(line, sizeof line, "error_hit %s\n", e->id);
            state_append(line);
            return e->code;
        }
    }
    return NVML_SUCCESS;
}

/* Locks, reloads the config, applies injected errors and the init check. Pair with fake_end. */
static nvmlReturn_t fake_begin(const char *fn, int needs_init) {
    pthread_mutex_lock(&g_lock);
    reload_config();
    if (!g_cfg.present) {
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    if (!g_cfg.valid) {
        return NVML_ERROR_UNKNOWN;
    }
    nvmlReturn_t rc = injected_error(fn);
    if (rc != NVML_SUCCESS) {
        return rc;
    }
    if (needs_init && g_init_count == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t fake_end(const char *fn, nvmlReturn_t rc) {
    if (g_cfg.trace) {
        char line[256];
        snprintf(line, sizeof line, "Call %s rc=%d\n", fn, (int)rc);
        log_append(line);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static nvmlReturn_t gpu_of(nvmlDevice_t device, fake_gpu **out, int allow_lost) {
    uintptr_t base = (uintptr_t)&g_handles[0], p = (uintptr_t)device;
    if (p < base || p >= base + sizeof g_handles || (p - base) % sizeof g_handles[0] != 0 ||
        device->index >= g_cfg.gpu_count) {
        return NVML_ERROR_INVALID_ARGUMENT; /* NULL and foreign pointers included */
    }
    fake_gpu *g = &g_cfg.gpus[device->index];
    if (g->lost && !allow_lost) {
        return NVML_ERROR_GPU_IS_LOST;
    }
    *out = g;
    return NVML_SUCCESS;
}

/* the uuid for the call log, also when the call itself failed early */
static const char *uuid_for_log(nvmlDevice_t device) {
    fake_gpu *g = NULL;
    if (g_cfg.valid && gpu_of(device, &g, 1) == NVML_SUCCESS) {
        return g->uuid;
    }
    return "-";
}

static nvmlReturn_t copy_out(char *dst, unsigned int length, const char *src) {
    if (dst == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    size_t need = strlen(src) + 1;
    if (length < need) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(dst, src, need);
    return NVML_SUCCESS;
}

static unsigned long long used_on(unsigned int gpu) {
    unsigned long long sum = 0;
    for (unsigned int i = 0; i < g_cfg.proc_count; i++) {
        if (g_cfg.procs[i].gpu == gpu &&
            g_cfg.procs[i].used != (unsigned long long)NVML_VALUE_NOT_AVAILABLE) {
            sum += g_cfg.procs[i].used;
        }
    }
    return sum;
}

/* ------------------------------------------------------------------------------------------ */
/* exported API                                                                               */

/* Test hook (not an NVML symbol): forget init refcount and caches, e.g. between tests. */
void fake_nvml_reset(void) {
    pthread_mutex_lock(&g_lock);
    g_init_count = 0;
    g_raw_len = (size_t)-1;
    memset(&g_cfg, 0, sizeof g_cfg);
    pthread_mutex_unlock(&g_lock);
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    nvmlReturn_t rc = fake_begin(__func__, 0);
    if (rc == NVML_SUCCESS && g_cfg.has_init_error) {
        rc = g_cfg.init_error;
    }
    if (rc == NVML_SUCCESS) {
        for (unsigned int i = 0; i < FAKE_MAX_GPUS; i++) {
            g_handles[i].index = i;
        }
        g_init_count++;
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlInit_v2(void) {
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        g_init_count--;
    }
    return fake_end(__func__, rc);
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt request issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = copy_out(version, length, g_cfg.driver);
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        if (deviceCount == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *deviceCount = g_cfg.gpu_count;
        }
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        if (device == NULL || index >= g_cfg.gpu_count) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *device = &g_handles[index];
        }
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        if (uuid == NULL || device == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            rc = NVML_ERROR_NOT_FOUND;
            for (unsigned int i = 0; i < g_cfg.gpu_count; i++) {
                if (strcmp(g_cfg.gpus[i].uuid, uuid) == 0) {
                    *device = &g_handles[i];
                    rc = NVML_SUCCESS;
                    break;
                }
            }
        }
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 1);
    }
    if (rc == NVML_SUCCESS) {
        if (index == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *index = g->index;
        }
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 1);
    }
    if (rc == NVML_SUCCESS) {
        rc = copy_out(uuid, length, g->uuid);
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 1);
    }
    if (rc == NVML_SUCCESS) {
        rc = copy_out(name, length, g->name);
    }
    return fake_end(__func__, rc);
}

static void memory_numbers(const fake_gpu *g, unsigned long long *reserved,
                           unsigned long long *used, unsigned long long *free_) {
    unsigned long long u = used_on(g->index);
    *reserved = g->reserved;
    *used = u;
    unsigned long long taken = g->reserved + u;
    *free_ = (taken >= g->total) ? 0 : g->total - taken;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 0);
    }
    if (rc == NVML_SUCCESS && memory == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS) {
        unsigned long long reserved, used, free_;
        memory_numbers(g, &reserved, &used, &free_);
        memory->total = g->total;
        memory->free = free_;
        memory->used = reserved + used; /* v1: "sum of reserved and allocated" */
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 0);
    }
    if (rc == NVML_SUCCESS && memory == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS && memory->version != nvmlMemory_v2) {
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    if (rc == NVML_SUCCESS) {
        unsigned long long reserved, used, free_;
        memory_numbers(g, &reserved, &used, &free_);
        memory->total = g->total;
        memory->reserved = reserved;
        memory->free = free_;
        memory->used = used;
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 0);
    }
    if (rc == NVML_SUCCESS && infoCount == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS) {
        unsigned int n = 0;
        for (unsigned int i = 0; i < g_cfg.proc_count; i++) {
            n += (g_cfg.procs[i].gpu == g->index);
        }
        if (*infoCount < n) {
            *infoCount = n;
            rc = NVML_ERROR_INSUFFICIENT_SIZE;
        } else if (n > 0 && infos == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            unsigned int k = 0;
            for (unsigned int i = 0; i < g_cfg.proc_count; i++) {
                const fake_proc *p = &g_cfg.procs[i];
                if (p->gpu != g->index) {
                    continue;
                }
                infos[k].pid = p->pid;
                infos[k].usedGpuMemory = p->used;
                infos[k].gpuInstanceId = 0xFFFFFFFFu;
                infos[k].computeInstanceId = 0xFFFFFFFFu;
                k++;
            }
            *infoCount = n;
        }
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 0);
    }
    if (rc == NVML_SUCCESS && mode == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS) {
        state_query q = {.kind = "compute_mode", .key1 = g->uuid};
        state_scan(&q);
        *mode = (nvmlComputeMode_t)(q.found ? (int)q.v1 : g->compute_mode);
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 0);
    }
    if (rc == NVML_SUCCESS && ((int)mode < 0 || (int)mode >= NVML_COMPUTEMODE_COUNT)) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS && mode == NVML_COMPUTEMODE_EXCLUSIVE_THREAD) {
        rc = NVML_ERROR_NOT_SUPPORTED; /* "Support Removed" in nvml.h */
    }
    char line[256];
    const char *uuid = uuid_for_log(device);
    if (rc == NVML_SUCCESS) {
        snprintf(line, sizeof line, "compute_mode %s %d\n", uuid, (int)mode);
        state_append(line);
    }
    snprintf(line, sizeof line, "SetComputeMode %s %d rc=%d\n", uuid, (int)mode, (int)rc);
    log_append(line);
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                  unsigned int *pendingMode) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 0);
    }
    if (rc == NVML_SUCCESS && (currentMode == NULL || pendingMode == NULL)) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS) {
        *currentMode = (unsigned int)g->mig;
        *pendingMode = (unsigned int)g->mig;
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 0);
    }
    if (rc == NVML_SUCCESS && processSamplesCount == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        unsigned long long now =
            (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull;
        unsigned int n = 0;
        for (unsigned int i = 0; i < g_cfg.proc_count; i++) {
            n += (g_cfg.procs[i].gpu == g->index && g_cfg.procs[i].has_sm);
        }
        if (n == 0 || now <= lastSeenTimeStamp) {
            rc = NVML_ERROR_NOT_FOUND; /* "sample entries are not found" */
        } else if (utilization == NULL || *processSamplesCount < n) {
            *processSamplesCount = n;
            rc = NVML_ERROR_INSUFFICIENT_SIZE;
        } else {
            unsigned int k = 0;
            for (unsigned int i = 0; i < g_cfg.proc_count; i++) {
                const fake_proc *p = &g_cfg.procs[i];
                if (p->gpu != g->index || !p->has_sm) {
                    continue;
                }
                utilization[k].pid = p->pid;
                utilization[k].timeStamp = now;
                utilization[k].smUtil = p->sm;
                utilization[k].memUtil = p->mem;
                utilization[k].encUtil = 0;
                utilization[k].decUtil = 0;
                k++;
            }
            *processSamplesCount = n;
        }
    }
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 0);
    }
    if (rc == NVML_SUCCESS && utilization == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS) {
        unsigned int sum = 0;
        for (unsigned int i = 0; i < g_cfg.proc_count; i++) {
            if (g_cfg.procs[i].gpu == g->index) {
                sum += g_cfg.procs[i].sm;
            }
        }
        utilization->gpu = (g->util_gpu >= 0) ? (unsigned int)g->util_gpu : (sum > 100 ? 100 : sum);
        utilization->memory = (unsigned int)g->util_memory;
    }
    return fake_end(__func__, rc);
}

#ifndef FAKE_NVML_OLD_DRIVER

/* Which directory `ns` is now, as one token ("-": none). Device, inode and, where the file
 * system keeps it, birth time: a directory removed and made again under the same path is
 * another one (its inode number may be reused, its birth time is not). */
static void dir_identity(const char *ns, char *out, size_t n) {
    struct statx st;
    if (statx(AT_FDCWD, ns, 0, STATX_TYPE | STATX_INO | STATX_BTIME, &st) != 0 ||
        !S_ISDIR(st.stx_mode)) {
        snprintf(out, n, "-");
        return;
    }
    int born = (st.stx_mask & STATX_BTIME) != 0;
    snprintf(out, n, "%x:%x:%llx:%lld.%u", st.stx_dev_major, st.stx_dev_minor,
             (unsigned long long)st.stx_ino, born ? (long long)st.stx_btime.tv_sec : 0LL,
             born ? st.stx_btime.tv_nsec : 0U);
}

/* nvml.h: both memory-limit calls return NVML_ERROR_OPERATING_SYSTEM "if the cgroup path
 * cannot be opened"; checked only with check_cgroups 1 (many tests name made-up paths). */
static nvmlReturn_t check_namespace(const char *ns) {
    if (ns == NULL || ns[0] != '/' || strlen(ns) > FAKE_MAX_NAMESPACE) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    struct stat st;
    if (g_cfg.check_cgroups && (stat(ns, &st) != 0 || !S_ISDIR(st.st_mode))) {
        return NVML_ERROR_OPERATING_SYSTEM;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 0);
    }
    if (rc == NVML_SUCCESS && limits == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS) {
        rc = check_namespace(limits->nameSpace);
    }
    if (rc == NVML_SUCCESS && limits->softLimit > limits->hardLimit) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    /* nvml.h: INVALID_ARGUMENT if "a limit exceeds total device memory"; a hard limit of
     * NVML_DEVICE_MEMORY_LIMIT_MAX is "no limit", not a size */
    if (rc == NVML_SUCCESS && (limits->softLimit > g->total ||
                               (limits->hardLimit > g->total &&
                                limits->hardLimit != NVML_DEVICE_MEMORY_LIMIT_MAX))) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS && g->mig) {
        rc = NVML_ERROR_NOT_SUPPORTED; /* MIG is not supported by cgroup memory limits */
    }
    char ns[3 * FAKE_MAX_NAMESPACE + 4];
    const char *raw_ns = (limits != NULL && limits->nameSpace != NULL) ? limits->nameSpace : "-";
    escape_field(raw_ns, ns, sizeof ns);
    const char *uuid = uuid_for_log(device);
    unsigned long long soft = (limits != NULL) ? limits->softLimit : 0;
    unsigned long long hard = (limits != NULL) ? limits->hardLimit : 0;
    char line[2 * sizeof ns + 512];
    if (rc == NVML_SUCCESS) {
        /* the limit and the directory it was set on, in one append: a get reads both or
         * neither (nvml.h: "Removing the cgroup will also clear any limits") */
        char id[FAKE_ID_LEN];
        dir_identity(limits->nameSpace, id, sizeof id);
        snprintf(line, sizeof line, "limit %s %s %llu %llu\nlimit_cgroup %s %s %s\n", uuid, ns,
                 soft, hard, uuid, ns, id);
        state_append(line);
    }
    snprintf(line, sizeof line, "SetMemoryLimits %s %s %llu %llu rc=%d\n", uuid, ns, soft, hard,
             (int)rc);
    log_append(line);
    return fake_end(__func__, rc);
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits) {
    fake_gpu *g = NULL;
    nvmlReturn_t rc = fake_begin(__func__, 1);
    if (rc == NVML_SUCCESS) {
        rc = gpu_of(device, &g, 0);
    }
    if (rc == NVML_SUCCESS && limits == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    if (rc == NVML_SUCCESS) {
        rc = check_namespace(limits->nameSpace);
    }
    if (rc == NVML_SUCCESS && g->mig) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    }
    if (rc == NVML_SUCCESS) {
        char ns[3 * FAKE_MAX_NAMESPACE + 4];
        escape_field(limits->nameSpace, ns, sizeof ns);
        state_query q = {.kind = "limit", .key1 = g->uuid, .key2 = ns};
        state_scan(&q);
        state_query dir = {.kind = "limit_cgroup", .key1 = g->uuid, .key2 = ns};
        state_scan(&dir);
        char now[FAKE_ID_LEN];
        dir_identity(limits->nameSpace, now, sizeof now);
        if (q.found && dir.found && strcmp(dir.text, "-") != 0 && strcmp(dir.text, now) != 0) {
            q.found = 0; /* set on a directory since removed (or made again): gone with it */
        }
        if (!q.found) {
            /* nvml.h: NVML_ERROR_NOT_FOUND "if the limits were not found for this device and
             * cgroup", the state of every cgroup no limit was ever set on */
            return fake_end(__func__, NVML_ERROR_NOT_FOUND);
        }
        limits->softLimit = q.v1;
        limits->hardLimit = q.v2;
        /* currentUsed: used bytes of this gpu's processes whose cgroup is the namespace or
         * below it (processes without cgroup= count for no namespace) */
        size_t len = strlen(limits->nameSpace);
        while (len > 1 && limits->nameSpace[len - 1] == '/') {
            len--;
        }
        unsigned long long sum = 0;
        for (unsigned int i = 0; i < g_cfg.proc_count; i++) {
            const fake_proc *p = &g_cfg.procs[i];
            if (p->gpu != g->index || p->cgroup[0] == '\0' ||
                p->used == (unsigned long long)NVML_VALUE_NOT_AVAILABLE) {
                continue;
            }
            if (strncmp(p->cgroup, limits->nameSpace, len) == 0 &&
                (p->cgroup[len] == '\0' || p->cgroup[len] == '/')) {
                sum += p->used;
            }
        }
        limits->currentUsed = sum;
    }
    return fake_end(__func__, rc);
}

#endif /* FAKE_NVML_OLD_DRIVER */
