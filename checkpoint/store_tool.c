/* checkpoint/store_tool.c — spotune-store-tool: the store API on the command
 * line, for users (inspect, fetch or clean a checkpoint bucket) and for
 * scripts/bench_store.sh. Credentials come from the environment only. */
#define _GNU_SOURCE
#include "checkpoint/store.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: spotune-store-tool [options] COMMAND URL ARGS...\n"
            "  put URL KEY FILE         upload FILE as KEY (--if-none-match: never replace)\n"
            "  get URL KEY FILE         download KEY into FILE\n"
            "  cat URL KEY              print KEY on stdout\n"
            "  ls URL [PREFIX]          list objects: size and key\n"
            "  stat URL KEY             print the size of KEY (exit 3 if missing)\n"
            "  rm URL KEY...            delete objects\n"
            "  push URL DIR PREFIX      push a checkpoint directory (MANIFEST.json last)\n"
            "  pull URL PREFIX DIR      pull a checkpoint directory (DIR must not exist)\n"
            "  prune URL KEEP [EVERY]   keep the newest KEEP step-*/ checkpoints (+ multiples of EVERY)\n"
            "  mb URL                   create the bucket (or directory)\n"
            "URL: file:///abs/path or s3://bucket[/prefix]\n"
            "options: --endpoint URL --region R --path-style --virtual-host --part-mb N\n"
            "         --parallel N --retries N --timeout S --if-none-match\n"
            "credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY [, AWS_SESSION_TOKEN];\n"
            "  or, without them, a role's: web identity, container or EC2 instance\n");
}

typedef struct tool {
    store_opts o;
    int inm;
} tool;

static int parse_opts(int argc, char **argv, tool *t)
{
    static const struct option lo[] = {
        {"endpoint", required_argument, 0, 'e'}, {"region", required_argument, 0, 'r'},
        {"path-style", no_argument, 0, 'p'},     {"virtual-host", no_argument, 0, 'v'},
        {"part-mb", required_argument, 0, 'm'},  {"parallel", required_argument, 0, 'j'},
        {"retries", required_argument, 0, 'R'},  {"timeout", required_argument, 0, 't'},
        {"if-none-match", no_argument, 0, 'n'},  {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "+h", lo, NULL)) != -1) {
        switch (c) {
        case 'e': t->o.endpoint = optarg; break;
        case 'r': t->o.region = optarg; break;
        case 'p': t->o.addressing = STORE_ADDR_PATH; break;
        case 'v': t->o.addressing = STORE_ADDR_VHOST; break;
        case 'm': t->o.part_bytes = (size_t)strtoull(optarg, NULL, 10) << 20; break;
        case 'j': t->o.parallel = atoi(optarg); break;
        case 'R': t->o.max_retries = atoi(optarg) > 0 ? atoi(optarg) : -1; break;
        case 't': t->o.timeout_s = atof(optarg); break;
        case 'n': t->inm = 1; break;
        case 'h': usage(stdout); exit(0);
        default: return -1;
        }
    }
    return 0;
}

static int cmd_ls(store_t *s, int argc, char **argv, sp_err *e)
{
    store_listing l;
    int rc = store_list(s, argc > 0 ? argv[0] : "", &l, e);
    for (size_t i = 0; !rc && i < l.n; i++)
        printf("%12llu  %s\n", (unsigned long long)l.items[i].size, l.items[i].key);
    store_list_free(&l);
    return rc;
}

static int cmd_cat(store_t *s, const char *key, sp_err *e)
{
    void *data;
    size_t n;
    int rc = store_get_bytes(s, key, &data, &n, e);
    if (!rc && fwrite(data, 1, n, stdout) != n)
        rc = sp_fail(e, SP_EXIT_OTHER, "stdout: write failed");
    free(data);
    return rc;
}

static int cmd_stat(store_t *s, const char *key, sp_err *e)
{
    int exists;
    uint64_t size;
    int rc = store_exists(s, key, &exists, &size, e);
    if (!rc && !exists)
        return sp_fail(e, SP_EXIT_INPUT, "%s/%s: no such object", store_url(s), key);
    if (!rc)
        printf("%llu\n", (unsigned long long)size);
    return rc;
}

static int cmd_rm(store_t *s, int argc, char **argv, sp_err *e)
{
    int rc = 0;
    for (int i = 0; i < argc && !rc; i++)
        rc = store_delete(s, argv[i], e);
    return rc;
}

static int cmd_prune(store_t *s, int argc, char **argv, sp_err *e)
{
    int n = 0;
    int rc = store_prune_steps(s, atoi(argv[0]), argc > 1 ? atoi(argv[1]) : 0, NULL, &n, e);
    if (!rc)
        printf("pruned %d checkpoint(s)\n", n);
    return rc;
}

/* argv[0] is the command, argv[1] the URL. */
static int run(const tool *t, store_t *s, int argc, char **argv, sp_err *e)
{
    const char *cmd = argv[0];
    int n = argc - 2; /* arguments after the URL */
    char **a = argv + 2;
    if (!strcmp(cmd, "put") && n == 2)
        return store_put_file(s, a[0], a[1], t->inm, e);
    if (!strcmp(cmd, "get") && n == 2)
        return store_get_file(s, a[0], a[1], e);
    if (!strcmp(cmd, "cat") && n == 1)
        return cmd_cat(s, a[0], e);
    if (!strcmp(cmd, "ls") && n <= 1)
        return cmd_ls(s, n, a, e);
    if (!strcmp(cmd, "stat") && n == 1)
        return cmd_stat(s, a[0], e);
    if (!strcmp(cmd, "rm") && n >= 1)
        return cmd_rm(s, n, a, e);
    if (!strcmp(cmd, "push") && n == 2)
        return store_push_dir(s, a[0], a[1], NULL, e);
    if (!strcmp(cmd, "pull") && n == 2)
        return store_pull_dir(s, a[0], a[1], NULL, e);
    if (!strcmp(cmd, "prune") && (n == 1 || n == 2))
        return cmd_prune(s, n, a, e);
    if (!strcmp(cmd, "mb") && n == 0)
        return store_create_bucket(s, e);
    return sp_fail(e, SP_EXIT_USAGE, "%s: unknown command or wrong arguments (see --help)", cmd);
}

int main(int argc, char **argv)
{
    tool t = {0};
    if (parse_opts(argc, argv, &t) || argc - optind < 2) {
        usage(stderr);
        return SP_EXIT_USAGE;
    }
    sp_err e = {0};
    store_t *s = NULL;
    if (store_open(&s, argv[optind + 1], &t.o, &e) == 0)
        run(&t, s, argc - optind, argv + optind, &e);
    store_close(s);
    if (e.code) {
        fflush(stdout);
        fprintf(stderr, "spotune-store-tool: %s\n", e.msg);
        return e.code;
    }
    return 0;
}
