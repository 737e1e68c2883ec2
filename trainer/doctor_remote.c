/* spotune doctor: the object store (credentials, probe object, upload speed,
 * clock skew) and the clouds' preemption notices. */
#define _GNU_SOURCE

#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <ifaddrs.h>
#include <jansson.h>
#include <net/if.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "../checkpoint/store.h"
#include "../comm/comm.h"
#include "../kernels/backend.h"
#include "config.h"
#include "data.h"
#include "doctor_internal.h"
#include "model.h"
#include "model_config.h"
#include "model_io.h"
#include "plan.h"

/* ---- object store ---------------------------------------------------------------- */

static size_t on_header(char *b, size_t size, size_t n, void *arg)
{
    size_t len = size * n;
    char *date = arg;
    if (len > 5 && !strncasecmp(b, "Date:", 5)) {
        size_t k = len - 5 < 127 ? len - 5 : 127;
        memcpy(date, b + 5, k);
        date[k] = 0;
        date[strcspn(date, "\r\n")] = 0;
    }
    return len;
}

static size_t discard(char *b, size_t size, size_t n, void *arg)
{
    (void)b;   /* the body is not wanted, */
    (void)arg; /* only its headers */
    return size * n;
}

/* The endpoint's base URL, as store_open would resolve it. */
static char *store_endpoint(const store_opts *o)
{
    if (o->endpoint && *o->endpoint)
        return strdup(o->endpoint);
    const char *e = getenv("AWS_ENDPOINT_URL_S3");
    if (!e || !*e)
        e = getenv("AWS_ENDPOINT_URL");
    if (e && *e)
        return strdup(e);
    const char *r = o->region && *o->region ? o->region : getenv("AWS_REGION");
    if (!r || !*r)
        r = getenv("AWS_DEFAULT_REGION");
    return sp_strf("https://s3.%s.amazonaws.com", r && *r ? r : "us-east-1");
}

static void check_clock(doctor_t *d, const store_opts *o, double timeout_s)
{
    char *url = store_endpoint(o);
    char date[128] = "";
    CURL *h = curl_easy_init();
    CURLcode rc = CURLE_FAILED_INIT;
    if (h && url) {
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
        curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
        curl_easy_setopt(h, CURLOPT_HEADERDATA, date);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, discard);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)(timeout_s * 1000));
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
        const char *ca = getenv("AWS_CA_BUNDLE");
        if (ca && *ca)
            curl_easy_setopt(h, CURLOPT_CAINFO, ca);
        rc = curl_easy_perform(h);
    }
    double now = sp_wall_time();
    if (h)
        curl_easy_cleanup(h);
    const char *expect = "|skew| <= 60 s (SigV4 fails beyond 15 min)";
    if (rc != CURLE_OK) {
        doctor_add(d, "store.clock_skew", DR_FAIL, expect, "%s did not answer: %s", url ? url : "",
                   curl_easy_strerror(rc));
    } else if (!date[0]) {
        doctor_add(d, "store.clock_skew", DR_WARN, expect, "%s sent no Date header", url);
    } else {
        time_t t = curl_getdate(date, NULL);
        if (t < 0) {
            doctor_add(d, "store.clock_skew", DR_WARN, expect, "%s: unreadable Date header '%s'",
                       url, date);
        } else {
            /* Date has whole seconds: up to 1 s of the gap is its rounding */
            double skew = now - (double)t;
            double a = skew < 0 ? -skew : skew;
            doctor_add(d, "store.clock_skew",
                       a > 900  ? DR_FAIL
                       : a > 60 ? DR_WARN
                                : DR_PASS,
                       expect, "this clock is %.0f s %s the store's (Date:%s)%s", a,
                       skew >= 0 ? "ahead of" : "behind", date,
                       a > 900 ? ": requests will be refused (RequestTimeTooSkewed); fix the "
                                 "clock (chrony, ntpdate)"
                               : "");
        }
    }
    free(url);
}

static const char *cause(int rc)
{
    switch (rc) {
    case STORE_EAUTH:
        return " [cause: the store refused the credentials or their rights (401/403)]";
    case STORE_ENOBUCKET: return " [cause: no such bucket]";
    case STORE_EFAIL: return " [cause: the store did not answer or failed]";
    default: return "";
    }
}

void dr_check_store(doctor_t *d, const char *url, const store_opts *so, int io_mib,
                    double deadline_s)
{
    int s3 = sp_after(url, "s3://") != NULL;
    if (s3) {
        const char *expect = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment, "
                             "or an EC2 instance role";
        char source[600];
        sp_err ce = {0};
        if (store_s3_credentials(source, sizeof source, &ce)) {
            doctor_add(d, "store.credentials", DR_FAIL, expect, "%s", ce.msg);
            doctor_add(d, "store.roundtrip", DR_SKIPPED, "", "no credentials");
            doctor_add(d, "store.upload", DR_SKIPPED, "", "no credentials");
            check_clock(d, so, 5);
            return;
        }
        doctor_add(d, "store.credentials", DR_PASS, expect, "from %s (values not shown)",
                   source);
    } else {
        doctor_add(d, "store.credentials", DR_SKIPPED, "", "%s needs none", url);
    }

    sp_err err = {0};
    store_t *st = NULL;
    const char *expect = "put, get, compare, list, delete";
    if (store_open(&st, url, so, &err)) {
        doctor_add(d, "store.roundtrip", DR_FAIL, expect, "%s", err.msg);
        doctor_add(d, "store.upload", DR_SKIPPED, "", "the store could not be opened");
        if (s3)
            check_clock(d, so, 5);
        else
            doctor_add(d, "store.clock_skew", DR_SKIPPED, "", "file:// has no clock");
        return;
    }
    char host[64];
    if (gethostname(host, sizeof host) != 0)
        strcpy(host, "host");
    host[sizeof host - 1] = 0;
    uint64_t tag = sp_rng_u64((uint64_t)getpid(), (uint64_t)(sp_wall_time() * 1e6));
    char *key = sp_strf(".spotune-doctor-%s-%ld-%08llx", host, (long)getpid(),
                        (unsigned long long)(tag & 0xffffffffu));
    char probe[4096];
    for (size_t i = 0; i < sizeof probe; i++)
        probe[i] = (char)(sp_rng_u64(tag, i) >> 56);
    double t0 = sp_now();
    void *back = NULL;
    size_t nback = 0;
    store_listing ls = {0};
    int rc, found = 0, exists = 1;
    const char *step = "PUT";
    if (!key) {
        rc = sp_fail(&err, SP_EXIT_OTHER, "out of memory");
    } else if ((rc = store_put_bytes(st, key, probe, sizeof probe, 0, &err)) == 0) {
        step = "GET";
        if ((rc = store_get_bytes(st, key, &back, &nback, &err)) == 0) {
            step = "LIST";
            if ((rc = store_list(st, ".spotune-doctor-", &ls, &err)) == 0) {
                for (size_t i = 0; i < ls.n; i++)
                    if (!strcmp(ls.items[i].key, key))
                        found = 1;
                step = "DELETE";
                if ((rc = store_delete(st, key, &err)) == 0)
                    rc = store_exists(st, key, &exists, NULL, &err);
            }
        }
    }
    double dt = sp_now() - t0;
    if (rc) {
        doctor_add(d, "store.roundtrip", DR_FAIL, expect,
                   "%s of a probe object failed after %.1f s: %s%s",
                   step, dt, err.msg, cause(rc));
        if (key && strcmp(step, "PUT") != 0) {
            sp_err e2 = {0};
            store_delete(st, key, &e2);
        }
    } else if (nback != sizeof probe || memcmp(back, probe, sizeof probe) != 0) {
        doctor_add(d, "store.roundtrip", DR_FAIL, expect,
                   "%s/%s read back differs from what was written (%zu bytes, %zu expected)",
                   url, key, nback, sizeof probe);
    } else if (!found) {
        doctor_add(d, "store.roundtrip", DR_FAIL, expect,
                   "%s/%s was written and read back but the listing does not show it", url, key);
    } else if (exists) {
        doctor_add(d, "store.roundtrip", DR_FAIL, expect, "%s/%s is still there after DELETE", url,
                   key);
    } else {
        doctor_add(d, "store.roundtrip", DR_PASS, expect,
                   "%s: 4 KiB probe put, read back equal, listed, deleted in %.2f s", url, dt);
    }
    free(back);
    store_list_free(&ls);

    if (rc) {
        doctor_add(d, "store.upload", DR_SKIPPED, "", "the probe object failed");
    } else {
        size_t n = (size_t)(io_mib < 32 ? io_mib : 32) << 20;
        char *big = malloc(n);
        char *bkey = key ? sp_strf("%s-upload", key) : NULL;
        if (!big || !bkey) {
            doctor_add(d, "store.upload", DR_FAIL, "", "out of memory");
        } else {
            for (size_t i = 0; i < n; i += 8) {
                uint64_t v = sp_rng_u64(tag + 1, i);
                memcpy(big + i, &v, n - i < 8 ? n - i : 8);
            }
            t0 = sp_now();
            int urc = store_put_bytes(st, bkey, big, n, 0, &err);
            dt = sp_now() - t0;
            sp_err e2 = {0};
            store_delete(st, bkey, &e2);
            if (urc)
                doctor_add(d, "store.upload", DR_FAIL, ">= 50 MB/s",
                           "uploading %zu MiB failed after %.1f s: %s%s", n >> 20, dt, err.msg,
                           cause(urc));
            else {
                double mbs = (double)n / 1e6 / (dt > 1e-9 ? dt : 1e-9);
                doctor_add(d, "store.upload", mbs >= 50 ? DR_PASS : DR_WARN,
                           ">= 50 MB/s (a 7B LoRA checkpoint in seconds; full fine-tuning: "
                           "tens of GB)",
                           "%.0f MB/s (%zu MiB in %.2f s, %s)", mbs, n >> 20, dt,
                           n > (so->part_bytes ? so->part_bytes : (size_t)16 << 20)
                               ? "multipart"
                               : "one PUT");
            }
        }
        free(big);
        free(bkey);
    }
    free(key);
    store_close(st);
    if (s3)
        check_clock(d, so, deadline_s < 5 ? deadline_s : 5);
    else
        doctor_add(d, "store.clock_skew", DR_SKIPPED, "", "file:// has no clock");
}

/* ---- preemption ------------------------------------------------------------------ */

typedef struct http_res {
    long code;
    char body[4096];
    size_t len;
    CURLcode rc;
} http_res;

static size_t on_body(char *b, size_t size, size_t n, void *arg)
{
    http_res *r = arg;
    size_t len = size * n, room = sizeof r->body - 1 - r->len;
    size_t k = len < room ? len : room;
    memcpy(r->body + r->len, b, k);
    r->len += k;
    r->body[r->len] = 0;
    return len;
}

/* One request of at most timeout_s; method NULL for GET. hdrs: NULL-ended. */
static void http(http_res *r, const char *method, const char *url, const char *const *hdrs,
                 double timeout_s)
{
    memset(r, 0, sizeof *r);
    CURL *h = curl_easy_init();
    if (!h) {
        r->rc = CURLE_FAILED_INIT;
        return;
    }
    struct curl_slist *hl = NULL;
    for (int i = 0; hdrs && hdrs[i]; i++)
        hl = curl_slist_append(hl, hdrs[i]);
    curl_easy_setopt(h, CURLOPT_URL, url);
    if (method)
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_NOPROXY, "*"); /* link-local: never through a proxy */
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)(timeout_s * 1000));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
    r->rc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r->code);
    curl_slist_free_all(hl);
    curl_easy_cleanup(h);
}

static const char *meta_base(const char *cloud, const char *override)
{
    if (override && *override)
        return override;
    if (!strcmp(cloud, "gcp"))
        return "http://metadata.google.internal";
    if (!strcmp(cloud, "alibaba"))
        return "http://100.100.100.200";
    return "http://169.254.169.254";
}

/* Whether cloud's metadata service answers (as spot-run.sh's detect_cloud). */
static int meta_answers(const char *cloud, const char *base)
{
    http_res r;
    char *u = NULL;
    int ok = 0;
    if (!strcmp(cloud, "aws")) {
        const char *h[] = {"X-aws-ec2-metadata-token-ttl-seconds: 60", NULL};
        u = sp_strf("%s/latest/api/token", base);
        http(&r, "PUT", u, h, 1);
        ok = r.rc == CURLE_OK && r.code == 200;
    } else if (!strcmp(cloud, "gcp")) {
        const char *h[] = {"Metadata-Flavor: Google", NULL};
        u = sp_strf("%s/computeMetadata/v1/instance/id", base);
        http(&r, NULL, u, h, 1);
        ok = r.rc == CURLE_OK && r.code == 200;
    } else if (!strcmp(cloud, "azure")) {
        const char *h[] = {"Metadata: true", NULL};
        u = sp_strf("%s/metadata/instance?api-version=2021-02-01", base);
        http(&r, NULL, u, h, 1);
        ok = r.rc == CURLE_OK && strstr(r.body, "compute") != NULL;
    } else if (!strcmp(cloud, "alibaba")) {
        u = sp_strf("%s/latest/meta-data/instance-id", base);
        http(&r, NULL, u, NULL, 1);
        ok = r.rc == CURLE_OK && r.code == 200;
    }
    free(u);
    return ok;
}

/* 1: a notice is pending, 0: none, -1: the service did not answer (why). */
static int meta_notice(const char *cloud, const char *base, char *why, size_t n)
{
    http_res r;
    char *u = NULL;
    int notice = -1;
    if (!strcmp(cloud, "aws")) {
        const char *h[] = {"X-aws-ec2-metadata-token-ttl-seconds: 300", NULL};
        u = sp_strf("%s/latest/api/token", base);
        http(&r, "PUT", u, h, 2);
        if (r.rc == CURLE_OK && r.code == 200) {
            char tok[600];
            sp_cutf(tok, sizeof tok, "X-aws-ec2-metadata-token: %s", r.body);
            const char *h2[] = {tok, NULL};
            free(u);
            u = sp_strf("%s/latest/meta-data/spot/instance-action", base);
            http(&r, NULL, u, h2, 2);
            if (r.rc == CURLE_OK)
                notice = r.code == 200;
        }
    } else if (!strcmp(cloud, "gcp")) {
        const char *h[] = {"Metadata-Flavor: Google", NULL};
        u = sp_strf("%s/computeMetadata/v1/instance/preempted", base);
        http(&r, NULL, u, h, 2);
        if (r.rc == CURLE_OK && r.code == 200)
            notice = !strncmp(r.body, "TRUE", 4);
    } else if (!strcmp(cloud, "azure")) {
        const char *h[] = {"Metadata: true", NULL};
        u = sp_strf("%s/metadata/scheduledevents?api-version=2020-07-01", base);
        http(&r, NULL, u, h, 2);
        if (r.rc == CURLE_OK && r.code == 200) {
            json_t *j = json_loadb(r.body, r.len, 0, NULL);
            json_t *ev = json_object_get(j, "Events");
            notice = 0;
            for (size_t i = 0; i < json_array_size(ev); i++) {
                json_t *e = json_array_get(ev, i);
                const char *t = json_string_value(json_object_get(e, "EventType"));
                if (t && !strcmp(t, "Preempt"))
                    notice = 1;
            }
            json_decref(j);
        }
    } else if (!strcmp(cloud, "alibaba")) {
        u = sp_strf("%s/latest/meta-data/instance/spot/termination-time", base);
        http(&r, NULL, u, NULL, 2);
        if (r.rc == CURLE_OK)
            notice = r.code == 200;
    }
    if (notice < 0)
        sp_cutf(why, n, "%s: %s", u ? u : base,
                r.rc != CURLE_OK ? curl_easy_strerror(r.rc) : "unexpected answer");
    else if (notice)
        sp_cutf(why, n, "%s", r.body);
    free(u);
    return notice;
}

void dr_check_preemption(doctor_t *d, const char *cloud_opt, const char *meta_url)
{
    static const char *const clouds[] = {"aws", "gcp", "azure", "alibaba"};
    const char *cloud = NULL;
    const char *expect = "a cloud's spot metadata service answers (spot-run.sh watches it)";
    if (!strcmp(cloud_opt, "none")) {
        doctor_add(d, "preemption.cloud", DR_SKIPPED, expect, "--cloud none");
        doctor_add(d, "preemption.notice", DR_SKIPPED, "no notice pending", "--cloud none");
        return;
    }
    if (!strcmp(cloud_opt, "auto")) {
        for (size_t i = 0; !cloud && i < sizeof clouds / sizeof clouds[0]; i++)
            if (meta_answers(clouds[i], meta_base(clouds[i], meta_url)))
                cloud = clouds[i];
        if (!cloud) {
            doctor_add(d, "preemption.cloud", DR_SKIPPED, expect,
                       "no cloud metadata service answered%s%s (not a cloud machine, or it is "
                       "blocked): spot-run.sh's notice watcher would be off",
                       meta_url ? " at " : "", meta_url ? meta_url : "");
            doctor_add(d, "preemption.notice", DR_SKIPPED, "no notice pending",
                       "no metadata service");
            return;
        }
        doctor_add(d, "preemption.cloud", DR_PASS, expect, "%s (%s)", cloud,
                   meta_base(cloud, meta_url));
    } else {
        cloud = cloud_opt;
        doctor_add(d, "preemption.cloud", DR_PASS, expect, "%s (--cloud, %s)", cloud,
                   meta_base(cloud, meta_url));
    }
    char why[600] = "";
    int n = meta_notice(cloud, meta_base(cloud, meta_url), why, sizeof why);
    if (n < 0)
        doctor_add(d, "preemption.notice", DR_WARN, "no notice pending",
                   "%s's notice endpoint did not answer: %s", cloud, why);
    else if (n)
        doctor_add(d, "preemption.notice", DR_FAIL, "no notice pending",
                   "a %s termination notice is pending (%.200s): this machine is going away", cloud,
                   why);
    else
        doctor_add(d, "preemption.notice", DR_PASS, "no notice pending", "none from %s", cloud);
}

