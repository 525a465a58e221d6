/*
 * selftest.c - drives fake_nvml.c directly, for a build with -fsanitize=address,undefined
 * (tests/tools/test_fake_nvml_sanitizers.py): leaks, overflows and UB show up as a failure.
 * Usage: selftest <work dir>   (writes <dir>/nvml.conf, .state, .log)
 */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void fake_nvml_reset(void);

static int failures;

static void worker_failed(const char *what, nvmlReturn_t rc) {
    fprintf(stderr, "selftest worker: %s returned %d\n", what, (int)rc);
    __atomic_add_fetch(&failures, 1, __ATOMIC_SEQ_CST);
}
static char g_cfg[4096];

#define CHECK(cond)                                                                    \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            fprintf(stderr, "selftest.c:%d: CHECK failed: %s\n", __LINE__, #cond);     \
            failures++;                                                                \
        }                                                                              \
    } while (0)

static void write_config(const char *text) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", g_cfg);
    FILE *f = fopen(tmp, "w");
    if (f == NULL) {
        perror(tmp);
        exit(2);
    }
    fputs(text, f);
    fclose(f);
    rename(tmp, g_cfg);
}

static void *worker(void *arg) {
    long n = (long)arg;
    nvmlDevice_t dev;
    nvmlReturn_t rc = nvmlDeviceGetHandleByIndex_v2((unsigned int)(n % 2), &dev);
    if (rc != NVML_SUCCESS) {
        worker_failed("nvmlDeviceGetHandleByIndex_v2", rc);
        return NULL;
    }
    for (int i = 0; i < 200; i++) {
        unsigned int count = 8;
        nvmlProcessInfo_t infos[8];
        rc = nvmlDeviceGetComputeRunningProcesses_v3(dev, &count, infos);
        if (rc != NVML_SUCCESS) {
            worker_failed("nvmlDeviceGetComputeRunningProcesses_v3", rc);
        }
        nvmlMemory_v2_t mem = {.version = nvmlMemory_v2};
        rc = nvmlDeviceGetMemoryInfo_v2(dev, &mem);
        if (rc != NVML_SUCCESS) {
            worker_failed("nvmlDeviceGetMemoryInfo_v2", rc);
        }
#ifndef FAKE_NVML_OLD_DRIVER
        char ns[128];
        snprintf(ns, sizeof ns, "/sys/fs/cgroup/t%ld", n);
        nvmlSetMemoryLimits_v1_t set = {.nameSpace = ns, .softLimit = (unsigned long long)i,
                                        .hardLimit = (unsigned long long)i + 1};
        rc = nvmlDeviceSetMemoryLimits_v1(dev, &set);
        if (rc != NVML_SUCCESS) {
            worker_failed("nvmlDeviceSetMemoryLimits_v1", rc);
        }
#endif
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s <dir>\n", argv[0]);
        return 2;
    }
    snprintf(g_cfg, sizeof g_cfg, "%s/nvml.conf", argv[1]);
    setenv("KAI_FAKE_NVML_CONFIG", g_cfg, 1);

    /* no config yet */
    CHECK(nvmlInit_v2() == NVML_ERROR_DRIVER_NOT_LOADED);

    write_config("driver_version 615.1.2\n"
                 "gpu uuid=GPU-a memory=1000 reserved=10 name=Fake  GPU  A\n"
                 "gpu uuid=GPU-b memory=2000 mig=1\n"
                 "process gpu=0 pid=7 used=100 sm=40 cgroup=/sys/fs/cgroup/pod/c\n"
                 "process gpu=0 pid=8 used=na\n"
                 "error nvmlDeviceGetIndex 4 times=2 id=idx\n");
    unsigned int count = 0;
    CHECK(nvmlDeviceGetCount_v2(&count) == NVML_ERROR_UNINITIALIZED);
    CHECK(nvmlInitWithFlags(0) == NVML_SUCCESS);
    CHECK(nvmlInit_v2() == NVML_SUCCESS);

    char buf[96];
    CHECK(nvmlSystemGetDriverVersion(buf, sizeof buf) == NVML_SUCCESS && strcmp(buf, "615.1.2") == 0);
    CHECK(nvmlSystemGetDriverVersion(buf, 3) == NVML_ERROR_INSUFFICIENT_SIZE);
    CHECK(nvmlDeviceGetCount_v2(NULL) == NVML_ERROR_INVALID_ARGUMENT);
    CHECK(nvmlDeviceGetCount_v2(&count) == NVML_SUCCESS && count == 2);
    nvmlDevice_t a, b, c;
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &a) == NVML_SUCCESS);
    CHECK(nvmlDeviceGetHandleByIndex_v2(5, &c) == NVML_ERROR_INVALID_ARGUMENT);
    CHECK(nvmlDeviceGetHandleByUUID("GPU-b", &b) == NVML_SUCCESS);
    CHECK(nvmlDeviceGetHandleByUUID("GPU-zzz", &c) == NVML_ERROR_NOT_FOUND);
    CHECK(nvmlDeviceGetHandleByUUID(NULL, &c) == NVML_ERROR_INVALID_ARGUMENT);
    CHECK(nvmlDeviceGetName(a, buf, sizeof buf) == NVML_SUCCESS && strcmp(buf, "Fake  GPU  A") == 0);
    CHECK(nvmlDeviceGetUUID(b, buf, sizeof buf) == NVML_SUCCESS && strcmp(buf, "GPU-b") == 0);
    CHECK(nvmlDeviceGetUUID((nvmlDevice_t)buf, buf, sizeof buf) == NVML_ERROR_INVALID_ARGUMENT);
    unsigned int idx = 9;
    CHECK(nvmlDeviceGetIndex(b, &idx) == NVML_ERROR_NO_PERMISSION);
    CHECK(nvmlDeviceGetIndex(b, &idx) == NVML_ERROR_NO_PERMISSION);
    CHECK(nvmlDeviceGetIndex(b, &idx) == NVML_SUCCESS && idx == 1);

    nvmlMemory_t m1;
    CHECK(nvmlDeviceGetMemoryInfo(a, &m1) == NVML_SUCCESS && m1.used == 110 && m1.free == 890);
    nvmlMemory_v2_t m2 = {.version = 1};
    CHECK(nvmlDeviceGetMemoryInfo_v2(a, &m2) == NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    m2.version = nvmlMemory_v2;
    CHECK(nvmlDeviceGetMemoryInfo_v2(a, &m2) == NVML_SUCCESS && m2.used == 100 && m2.reserved == 10);

    count = 0;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(a, &count, NULL) == NVML_ERROR_INSUFFICIENT_SIZE &&
          count == 2);
    nvmlProcessInfo_t infos[2];
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(a, &count, infos) == NVML_SUCCESS &&
          infos[0].pid == 7 && infos[1].usedGpuMemory == (unsigned long long)NVML_VALUE_NOT_AVAILABLE);
    count = 0;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(b, &count, NULL) == NVML_SUCCESS && count == 0);

    unsigned int n = 0;
    CHECK(nvmlDeviceGetProcessUtilization(a, NULL, &n, 0) == NVML_ERROR_INSUFFICIENT_SIZE && n == 1);
    nvmlProcessUtilizationSample_t s[1];
    CHECK(nvmlDeviceGetProcessUtilization(a, s, &n, 0) == NVML_SUCCESS && s[0].smUtil == 40);
    CHECK(nvmlDeviceGetProcessUtilization(b, NULL, &n, 0) == NVML_ERROR_NOT_FOUND);
    nvmlUtilization_t u;
    CHECK(nvmlDeviceGetUtilizationRates(a, &u) == NVML_SUCCESS && u.gpu == 40);

    unsigned int cur = 9, pend = 9;
    CHECK(nvmlDeviceGetMigMode(b, &cur, &pend) == NVML_SUCCESS && cur == 1 && pend == 1);
    nvmlComputeMode_t mode;
    CHECK(nvmlDeviceSetComputeMode(a, NVML_COMPUTEMODE_EXCLUSIVE_PROCESS) == NVML_SUCCESS);
    CHECK(nvmlDeviceSetComputeMode(a, (nvmlComputeMode_t)17) == NVML_ERROR_INVALID_ARGUMENT);
    CHECK(nvmlDeviceGetComputeMode(a, &mode) == NVML_SUCCESS &&
          mode == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS);

#ifndef FAKE_NVML_OLD_DRIVER
    nvmlSetMemoryLimits_v1_t set = {.nameSpace = "/sys/fs/cgroup/pod", .softLimit = 5, .hardLimit = 50};
    CHECK(nvmlDeviceSetMemoryLimits_v1(a, &set) == NVML_SUCCESS);
    CHECK(nvmlDeviceSetMemoryLimits_v1(b, &set) == NVML_ERROR_NOT_SUPPORTED); /* mig */
    set.nameSpace = NULL;
    CHECK(nvmlDeviceSetMemoryLimits_v1(a, &set) == NVML_ERROR_INVALID_ARGUMENT);
    set.nameSpace = "/with space/%";
    CHECK(nvmlDeviceSetMemoryLimits_v1(a, &set) == NVML_SUCCESS);
    nvmlGetMemoryLimits_v1_t get = {.nameSpace = "/sys/fs/cgroup/pod"};
    CHECK(nvmlDeviceGetMemoryLimits_v1(a, &get) == NVML_SUCCESS && get.softLimit == 5 &&
          get.hardLimit == 50 && get.currentUsed == 100);
    get.nameSpace = "/with space/%";
    CHECK(nvmlDeviceGetMemoryLimits_v1(a, &get) == NVML_SUCCESS && get.hardLimit == 50);
    get.nameSpace = "/sys/fs/cgroup/po"; /* never limited: nvml.h's NOT_FOUND */
    CHECK(nvmlDeviceGetMemoryLimits_v1(a, &get) == NVML_ERROR_NOT_FOUND);
    set.nameSpace = "/sys/fs/cgroup/po"; /* a prefix that is not a parent */
    CHECK(nvmlDeviceSetMemoryLimits_v1(a, &set) == NVML_SUCCESS);
    CHECK(nvmlDeviceGetMemoryLimits_v1(a, &get) == NVML_SUCCESS && get.currentUsed == 0 &&
          get.hardLimit == 50);

    /* a limit goes with its directory: removed, or made again, it reads back NOT_FOUND (its
     * calls logged apart: tests/tools/test_fake_nvml_sanitizers.py counts the main log's) */
    char dir[4200], cglog[4200];
    snprintf(dir, sizeof dir, "%s/cg", argv[1]);
    snprintf(cglog, sizeof cglog, "%s/cgroups.log", argv[1]);
    setenv("KAI_FAKE_NVML_LOG", cglog, 1);
    CHECK(mkdir(dir, 0755) == 0);
    set.nameSpace = dir;
    get.nameSpace = dir;
    CHECK(nvmlDeviceSetMemoryLimits_v1(a, &set) == NVML_SUCCESS);
    CHECK(nvmlDeviceGetMemoryLimits_v1(a, &get) == NVML_SUCCESS && get.hardLimit == 50);
    CHECK(rmdir(dir) == 0);
    CHECK(nvmlDeviceGetMemoryLimits_v1(a, &get) == NVML_ERROR_NOT_FOUND);
    CHECK(mkdir(dir, 0755) == 0);
    CHECK(nvmlDeviceGetMemoryLimits_v1(a, &get) == NVML_ERROR_NOT_FOUND);
    /* check_cgroups 1: a namespace that is not a directory cannot be opened */
    write_config("gpu uuid=GPU-a memory=1000\ngpu uuid=GPU-b memory=2000 mig=1\n"
                 "check_cgroups 1\n");
    CHECK(nvmlDeviceSetMemoryLimits_v1(a, &set) == NVML_SUCCESS);
    CHECK(rmdir(dir) == 0);
    CHECK(nvmlDeviceSetMemoryLimits_v1(a, &set) == NVML_ERROR_OPERATING_SYSTEM);
    CHECK(nvmlDeviceGetMemoryLimits_v1(a, &get) == NVML_ERROR_OPERATING_SYSTEM);
    set.nameSpace = "/sys/fs/cgroup/pod-not-here";
    CHECK(nvmlDeviceSetMemoryLimits_v1(a, &set) == NVML_ERROR_OPERATING_SYSTEM);
    unsetenv("KAI_FAKE_NVML_LOG");
#endif

    write_config("gpu uuid=GPU-a memory=1000\ngpu uuid=GPU-b memory=2000\n");
    pthread_t threads[4];
    for (long t = 0; t < 4; t++) {
        pthread_create(&threads[t], NULL, worker, (void *)t);
    }
    /* rewrite the config while the workers run */
    for (int i = 0; i < 20; i++) {
        char text[512];
        snprintf(text, sizeof text,
                 "gpu uuid=GPU-a memory=1000\ngpu uuid=GPU-b memory=%d\n"
                 "process gpu=1 pid=%d used=1\n",
                 2000 + i, 100 + i);
        write_config(text);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(threads[t], NULL);
    }

    write_config("gpu uuid=GPU-a memory=1000\nbroken directive\n");
    CHECK(nvmlDeviceGetCount_v2(&count) == NVML_ERROR_UNKNOWN);
    write_config("init_error 9\n");
    CHECK(nvmlInit_v2() == NVML_ERROR_DRIVER_NOT_LOADED);
    CHECK(strcmp(nvmlErrorString(NVML_ERROR_NO_PERMISSION), "Insufficient Permissions") == 0);
    CHECK(nvmlShutdown() == NVML_SUCCESS);
    CHECK(nvmlShutdown() == NVML_SUCCESS);
    CHECK(nvmlShutdown() == NVML_ERROR_UNINITIALIZED);
    fake_nvml_reset();

    if (failures != 0) {
        fprintf(stderr, "selftest: %d failure(s)\n", failures);
        return 1;
    }
    printf("selftest: ok\n");
    return 0;
}
