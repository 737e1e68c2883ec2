/* tests/test_store_wire.c — the S3 client's requests on the wire, against an
 * in-process fake endpoint that records each request and plays back canned
 * answers (no server needed): signing headers, payload hash, temporary
 * credentials, key encoding, the retry policy (503 SlowDown retried, 403
 * reported at once), and an EC2 instance role's credentials from a fake
 * metadata service (tests/tools/fake_metadata.py): signed with, renewed
 * before they expire (without holding up the other requests) and when the
 * store says they have, refused by name when the service cannot give them. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "checkpoint/store.h"
#include "checkpoint/store_impl.h"
#include "checkpoint/store_s3.h"
#include "test_util.h"

TestSuite(store_wire, .timeout = 60);

enum { MAX_REQ = 8 };

typedef struct fake {
    int listen_fd, port;
    const char *answers[MAX_REQ]; /* one per connection; NULL ends */
    char *requests[MAX_REQ];
    int n;
    pthread_t th;
} fake;

static char *read_request(int fd)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = calloc(1, cap + 1);
    while (n < cap) {
        ssize_t k = read(fd, buf + n, cap - n);
        if (k <= 0)
            break;
        n += (size_t)k;
        char *end = strstr(buf, "\r\n\r\n");
        if (!end)
            continue;
        const char *cl = strcasestr(buf, "content-length:");
        size_t body = cl ? strtoul(cl + SP_LEN("content-length:"), NULL, 10) : 0;
        if (n >= (size_t)(end + 4 - buf) + body)
            break;
    }
    return buf;
}

static void *serve(void *arg)
{
    fake *f = arg;
    for (int i = 0; i < MAX_REQ && f->answers[i]; i++) {
        int c = accept(f->listen_fd, NULL, NULL);
        if (c < 0)
            break;
        f->requests[i] = read_request(c);
        f->n = i + 1;
        ssize_t w = write(c, f->answers[i], strlen(f->answers[i]));
        (void)w;
        close(c);
    }
    return NULL;
}

static void fake_start(fake *f)
{
    f->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(bind(f->listen_fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(f->listen_fd, 8), 0);
    socklen_t len = sizeof a;
    getsockname(f->listen_fd, (struct sockaddr *)&a, &len);
    f->port = ntohs(a.sin_port);
    cr_assert_eq(pthread_create(&f->th, NULL, serve, f), 0);
}

/* Stops the server; the recorded requests stay readable until fake_free. */
static void fake_stop(fake *f)
{
    shutdown(f->listen_fd, SHUT_RDWR);
    close(f->listen_fd);
    pthread_join(f->th, NULL);
}

/* Stops a server still waiting for a connection that will not come (its
 * answers not all used): one empty connection releases its accept. */
static void fake_stop_unused(fake *f)
{
    int c = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)f->port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(c, (struct sockaddr *)&a, sizeof a), 0);
    close(c);
    fake_stop(f);
}

static void fake_free(fake *f)
{
    for (int i = 0; i < f->n; i++)
        free(f->requests[i]);
    f->n = 0;
}

static store_t *open_fake(const fake *f, const char *url, store_opts *o)
{
    char ep[64];
    snprintf(ep, sizeof ep, "http://127.0.0.1:%d", f->port);
    o->endpoint = ep;
    store_t *s = NULL;
    sp_err err = {0};
    cr_assert_eq(store_open(&s, url, o, &err), 0, "%s", err.msg);
    return s;
}

#define OK_EMPTY "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

static const char *header_line(const char *req, const char *name)
{
    const char *p = strcasestr(req, name);
    cr_assert_not_null(p, "no %s in:\n%s", name, req);
    return p;
}

Test(store_wire, put_signs_payload_hash_and_token_never_the_secret)
{
    setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-never-on-the-wire", 1);
    setenv("AWS_SESSION_TOKEN", "TOKEN-abc/123=", 1);
    fake f = {.answers = {OK_EMPTY}};
    fake_start(&f);
    store_opts o = {.region = "eu-west-3"};
    store_t *s = open_fake(&f, "s3://bkt/run 1", &o);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "step-1/a b+c.h5", "abc", 3, 0, &err), 0, "%s", err.msg);
    store_close(s);
    fake_stop(&f);
    const char *r = f.requests[0];
    cr_assert(!strncmp(r, "PUT /bkt/run%201/step-1/a%20b%2Bc.h5 HTTP/1.1\r\n", 47),
              "path-style, SigV4-encoded key:\n%s", r);
    /* SHA-256("abc") */
    header_line(r, "x-amz-content-sha256: "
                   "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\r\n");
    header_line(r, "x-amz-security-token: TOKEN-abc/123=\r\n");
    const char *auth = header_line(r, "Authorization: AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/");
    cr_assert(strstr(auth, "/eu-west-3/s3/aws4_request"), "%s", auth);
    cr_assert(strstr(auth, "x-amz-content-sha256;x-amz-date;x-amz-security-token"), "%s", auth);
    cr_assert_null(strstr(r, "s3cr3t"), "the secret is on the wire");
    fake_free(&f);
}

Test(store_wire, get_head_delete_send_the_empty_payload_hash)
{
    setenv("AWS_ACCESS_KEY_ID", "AKID", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "secret", 1);
    unsetenv("AWS_SESSION_TOKEN");
    fake f = {.answers = {"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n",
                          "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"}};
    fake_start(&f);
    store_opts o = {0};
    store_t *s = open_fake(&f, "s3://bkt", &o);
    sp_err err = {0};
    cr_assert_eq(store_delete(s, "k", &err), 0, "%s", err.msg);
    void *data;
    size_t n;
    cr_assert_eq(store_get_bytes(s, "k", &data, &n, &err), 0, "%s", err.msg);
    cr_assert_eq(n, 5);
    cr_assert_eq(memcmp(data, "hello", 5), 0);
    free(data);
    store_close(s);
    fake_stop(&f);
    cr_assert(!strncmp(f.requests[0], "DELETE /bkt/k ", 14), "%s", f.requests[0]);
    for (int i = 0; i < 2; i++) {
        header_line(f.requests[i], "x-amz-content-sha256: "
                                   "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        cr_assert_null(strcasestr(f.requests[i], "x-amz-security-token"));
    }
    fake_free(&f);
}

/* An XML error answer with a correct Content-Length (static storage). */
static const char *error_answer(int slot, const char *status, const char *code, const char *msg)
{
    static char buf[4][512];
    char body[256];
    int n = snprintf(body, sizeof body, "<Error><Code>%s</Code><Message>%s</Message></Error>",
                     code, msg);
    snprintf(buf[slot], sizeof buf[slot],
             "HTTP/1.1 %s\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
             "Connection: close\r\n\r\n%s",
             status, n, body);
    return buf[slot];
}

#define SLOWDOWN error_answer(0, "503 Slow Down", "SlowDown", "Please reduce your request rate.")
#define DENIED error_answer(1, "403 Forbidden", "AccessDenied", "Access Denied")

Test(store_wire, slowdown_is_retried_access_denied_is_not)
{
    setenv("AWS_ACCESS_KEY_ID", "AKID", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "secret", 1);
    fake f = {.answers = {SLOWDOWN, SLOWDOWN, OK_EMPTY, DENIED, OK_EMPTY}};
    fake_start(&f);
    store_opts o = {.retry_base_s = 0.01, .retry_max_s = 0.05};
    store_t *s = open_fake(&f, "s3://bkt/p", &o);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "a", "x", 1, 0, &err), 0, "after two 503s: %s", err.msg);
    cr_assert_eq(f.n, 3);
    int rc = store_put_bytes(s, "b", "x", 1, 0, &err);
    cr_assert_eq(rc, STORE_EAUTH);
    cr_assert_str_eq(err.msg, "s3://bkt/p/b: PUT failed: 403 AccessDenied: Access Denied");
    usleep(200 * 1000);
    cr_assert_eq(f.n, 4, "403 is not retried");
    store_close(s);
    fake_stop_unused(&f); /* the fifth answer is never asked for */
    fake_free(&f);
}

Test(store_wire, retries_give_up_with_the_last_reason)
{
    setenv("AWS_ACCESS_KEY_ID", "AKID", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "secret", 1);
    fake f = {.answers = {SLOWDOWN, SLOWDOWN, SLOWDOWN}};
    fake_start(&f);
    store_opts o = {.max_retries = 2, .retry_base_s = 0.01, .retry_max_s = 0.02};
    store_t *s = open_fake(&f, "s3://bkt", &o);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "k", "x", 1, 0, &err), STORE_EFAIL);
    cr_assert_str_eq(err.msg, "s3://bkt/k: PUT failed: 503 SlowDown: Please reduce your request "
                              "rate. (after 3 attempts)");
    cr_assert_eq(f.n, 3);
    store_close(s);
    fake_stop(&f);
    fake_free(&f);
}

/* A bucket in another region than the requests are signed for: AWS
 * answers 301 PermanentRedirect (a HEAD: 301 and no body) with the
 * bucket's region in x-amz-bucket-region, or 400
 * AuthorizationHeaderMalformed. Not retried, and a usage error naming the
 * region and the setting (the job ends at its start, exit 2, instead of
 * training on without ever pushing a checkpoint). */
/* 301 PermanentRedirect with the bucket's region, as AWS answers a PUT */
static const char *moved(void)
{
    static char buf[640];
    static const char body[] = "<Error><Code>PermanentRedirect</Code><Message>The bucket you are "
                               "attempting to access must be addressed using the specified "
                               "endpoint.</Message></Error>";
    snprintf(buf, sizeof buf,
             "HTTP/1.1 301 Moved Permanently\r\nx-amz-bucket-region: eu-west-1\r\n"
             "Content-Type: application/xml\r\nContent-Length: %zu\r\nConnection: close\r\n"
             "\r\n%s",
             sizeof body - 1, body);
    return buf;
}
#define MOVED_HEAD "HTTP/1.1 301 Moved Permanently\r\nx-amz-bucket-region: ap-south-1\r\n" \
                   "Content-Length: 0\r\nConnection: close\r\n\r\n"
#define MALFORMED error_answer(3, "400 Bad Request", "AuthorizationHeaderMalformed", \
                               "the region 'us-east-1' is wrong; expecting 'eu-west-1'")

Test(store_wire, a_bucket_in_another_region_is_a_usage_error_naming_it)
{
    setenv("AWS_ACCESS_KEY_ID", "AKID", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "secret", 1);
    fake f = {.answers = {moved(), MOVED_HEAD, MALFORMED}};
    fake_start(&f);
    store_opts o = {.retry_base_s = 0.01, .retry_max_s = 0.05};
    store_t *s = open_fake(&f, "s3://bkt", &o);
    sp_err err = {0};
    cr_expect_eq(store_put_bytes(s, "k", "x", 1, 0, &err), STORE_EUSAGE, "%s", err.msg);
    cr_expect(strstr(err.msg, "301 PermanentRedirect") &&
                  strstr(err.msg, "(the bucket is in region eu-west-1, not in this store's "
                                  "region: set checkpoint.region, or AWS_REGION)"),
              "%s", err.msg);
    cr_expect_eq(f.n, 1, "a wrong region is retried");
    int exists = -1;
    memset(&err, 0, sizeof err);
    cr_expect_eq(store_exists(s, "k", &exists, NULL, &err), STORE_EUSAGE, "HEAD: %s", err.msg);
    cr_expect(strstr(err.msg, "the bucket is in region ap-south-1"), "HEAD: %s", err.msg);
    memset(&err, 0, sizeof err);
    cr_expect_eq(store_put_bytes(s, "k", "x", 1, 0, &err), STORE_EUSAGE, "%s", err.msg);
    cr_expect(strstr(err.msg, "AuthorizationHeaderMalformed") &&
                  strstr(err.msg, "the bucket is in another region"), "%s", err.msg);
    cr_expect_eq(f.n, 3);
    store_close(s);
    fake_stop(&f);
    fake_free(&f);
}

/* A clock too far from the store's: retried (the clock is often set a
 * little after boot), not a refusal of the credentials. */
Test(store_wire, a_skewed_clock_is_retried)
{
    setenv("AWS_ACCESS_KEY_ID", "AKID", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "secret", 1);
    fake f = {.answers = {error_answer(0, "403 Forbidden", "RequestTimeTooSkewed",
                                       "The difference between the request time and the "
                                       "current time is too large."),
                          OK_EMPTY}};
    fake_start(&f);
    store_opts o = {.retry_base_s = 0.01, .retry_max_s = 0.05};
    store_t *s = open_fake(&f, "s3://bkt", &o);
    sp_err err = {0};
    cr_expect_eq(store_put_bytes(s, "k", "x", 1, 0, &err), 0, "%s", err.msg);
    cr_expect_eq(f.n, 2);
    store_close(s);
    fake_stop(&f);
    fake_free(&f);
}

/* The error document of a CompleteMultipartUpload comes after the spaces
 * S3 sends while it works (and its 200): it must still be read, or the
 * failed upload would be taken for done. */
Test(store_wire, an_error_after_white_space_is_read)
{
    static const char doc[] = "  \r\n \n<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error>"
                              "<Code>InternalError</Code><Message>We encountered an internal "
                              "error.</Message></Error>";
    membuf b = {.p = (unsigned char *)doc, .n = sizeof doc - 1};
    char *code = s3_xml_find(&b, "Code");
    cr_expect(code && !strcmp(code, "InternalError"), "code %s", code ? code : "(none)");
    free(code);
    membuf blank = {.p = (unsigned char *)"  \n", .n = 3};
    cr_expect_null(s3_xml_parse(&blank), "white space alone parsed as a document");
}

/* ---- an EC2 instance role's credentials ------------------------------------------ */

#define EXPIRED error_answer(2, "400 Bad Request", "ExpiredToken", \
                             "The provided token has expired.")

typedef struct role {
    char *dir, *creds, *fetches, *log;
    char url[64];
    int pid;
} role;

/* The fake metadata service serving the role's credentials as written by
 * role_serve; the environment's credentials unset, the service's address
 * set as the AWS SDKs read it. */
static void role_serve(role *r, const char *key_id, const char *token, int expires_in)
{
    char *json = sp_strf("{\"role\": \"spotune-test-role\", \"AccessKeyId\": \"%s\", "
                         "\"SecretAccessKey\": \"role-secret-never-printed\", \"Token\": \"%s\", "
                         "\"expires_in\": %d}",
                         key_id, token, expires_in);
    cr_assert_eq(tu_write_file(r->creds, json), 0);
    free(json);
}

static void role_start(role *r, const char *key_id, const char *token, int expires_in)
{
    memset(r, 0, sizeof *r);
    r->dir = tu_tempdir("role");
    r->creds = sp_strf("%s/creds.json", r->dir);
    r->fetches = sp_strf("%s/creds.json.fetches", r->dir);
    r->log = sp_strf("%s/meta.log", r->dir);
    role_serve(r, key_id, token, expires_in);
    char *args = sp_strf("--creds %s", r->creds);
    r->pid = tu_fake_metadata(r->log, args, r->url, sizeof r->url);
    free(args);
    unsetenv("AWS_ACCESS_KEY_ID");
    unsetenv("AWS_SECRET_ACCESS_KEY");
    unsetenv("AWS_SESSION_TOKEN");
    unsetenv("AWS_EC2_METADATA_DISABLED");
    setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", r->url, 1);
}

/* The access key ids the service handed out, one per line. */
static char *role_fetches(const role *r)
{
    char *f = tu_read_file(r->fetches, NULL);
    return f ? f : strdup("");
}

static void role_stop(role *r)
{
    kill(r->pid, SIGTERM);
    tu_wait(r->pid, 10);
    free(r->dir), free(r->creds), free(r->fetches), free(r->log);
}

static void expect_signed_by(const char *req, const char *key_id, const char *token)
{
    char want[128];
    snprintf(want, sizeof want, "Credential=%s/", key_id);
    cr_expect(strstr(header_line(req, "Authorization: "), want), "not signed by %s:\n%s", key_id,
              req);
    snprintf(want, sizeof want, "x-amz-security-token: %s\r\n", token);
    header_line(req, want);
    cr_expect_null(strstr(req, "role-secret"), "the secret is on the wire");
}

/* Opened with the role's credentials (fetched once); the store answers the
 * first PUT ExpiredToken: the credentials are fetched again (the service
 * has new ones by then) and the PUT sent again with them, once. */
Test(store_wire, a_roles_credentials_are_renewed_when_the_store_says_they_expired)
{
    role r;
    role_start(&r, "ASIAFIRST", "token-1", 21600);
    fake f = {.answers = {EXPIRED, OK_EMPTY, OK_EMPTY}};
    fake_start(&f);
    store_opts o = {.retry_base_s = 0.01, .retry_max_s = 0.05};
    store_t *s = open_fake(&f, "s3://bkt/p", &o);
    char *got = role_fetches(&r);
    cr_expect_str_eq(got, "ASIAFIRST\n", "fetched once at open");
    free(got);
    role_serve(&r, "ASIASECOND", "token-2", 21600);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "k", "x", 1, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(f.n, 2);
    expect_signed_by(f.requests[0], "ASIAFIRST", "token-1");
    expect_signed_by(f.requests[1], "ASIASECOND", "token-2");
    /* the new ones hold: the next request does not ask again */
    cr_assert_eq(store_put_bytes(s, "k2", "y", 1, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(f.n, 3);
    expect_signed_by(f.requests[2], "ASIASECOND", "token-2");
    got = role_fetches(&r);
    cr_expect_str_eq(got, "ASIAFIRST\nASIASECOND\n");
    free(got);
    store_close(s);
    fake_stop(&f);
    fake_free(&f);
    role_stop(&r);
}

/* Credentials with less than S3_CREDS_REFRESH_S (300 s) of life left are
 * renewed before a request (at most every 5 s: 303 s of life, 5.5 s later);
 * ones with hours left are used as they are. */
Test(store_wire, a_roles_credentials_are_renewed_before_they_expire)
{
    role r;
    role_start(&r, "ASIASHORT", "token-short", 303);
    fake f = {.answers = {OK_EMPTY, OK_EMPTY}};
    fake_start(&f);
    store_opts o = {0};
    store_t *s = open_fake(&f, "s3://bkt", &o);
    role_serve(&r, "ASIALONG", "token-long", 21600);
    tu_sleep(5.5);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "a", "x", 1, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(store_put_bytes(s, "b", "x", 1, 0, &err), 0, "%s", err.msg);
    expect_signed_by(f.requests[0], "ASIALONG", "token-long");
    expect_signed_by(f.requests[1], "ASIALONG", "token-long");
    char *got = role_fetches(&r);
    cr_expect_str_eq(got, "ASIASHORT\nASIALONG\n");
    free(got);
    store_close(s);
    fake_stop(&f);
    fake_free(&f);
    role_stop(&r);
}

typedef struct put_job {
    store_t *s;
    int rc;
    sp_err err;
} put_job;

static void *put_a(void *arg)
{
    put_job *j = arg;
    j->rc = store_put_bytes(j->s, "a", "x", 1, 0, &j->err);
    return NULL;
}

/* An early renewal does not hold up the other requests: while one request
 * waits for the service (2 s here), another goes out at once with the
 * credentials that still hold; the renewing request goes out with the new
 * ones, and so does the next. */
Test(store_wire, an_early_renewal_does_not_hold_up_other_requests)
{
    role r;
    role_start(&r, "ASIASHORT", "token-short", 303);
    fake f = {.answers = {OK_EMPTY, OK_EMPTY, OK_EMPTY}};
    fake_start(&f);
    store_opts o = {0};
    store_t *s = open_fake(&f, "s3://bkt", &o);
    char *json = sp_strf("{\"role\": \"spotune-test-role\", \"AccessKeyId\": \"ASIALONG\", "
                         "\"SecretAccessKey\": \"role-secret-never-printed\", \"Token\": "
                         "\"token-long\", \"expires_in\": 21600, \"delay_s\": 2}");
    cr_assert_eq(tu_write_file(r.creds, json), 0);
    free(json);
    tu_sleep(5.5); /* due: at most every 5 s */
    put_job a = {.s = s, .rc = -99};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, put_a, &a), 0);
    /* the renewal is in flight once the service has logged it */
    char *got = NULL;
    for (double t0 = sp_now(); sp_now() - t0 < 10; tu_sleep(0.02)) {
        free(got);
        got = role_fetches(&r);
        if (strstr(got, "ASIALONG"))
            break;
    }
    cr_assert(strstr(got, "ASIALONG"), "no renewal asked: %s", got);
    free(got);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "b", "x", 1, 0, &err), 0, "%s", err.msg);
    pthread_join(th, NULL);
    cr_assert_eq(a.rc, 0, "%s", a.err.msg);
    cr_assert_eq(store_put_bytes(s, "c", "x", 1, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(f.n, 3);
    /* b first, with the old ones; a after the service answered; c */
    cr_expect(strstr(f.requests[0], "PUT /bkt/b "), "%s", f.requests[0]);
    expect_signed_by(f.requests[0], "ASIASHORT", "token-short");
    cr_expect(strstr(f.requests[1], "PUT /bkt/a "), "%s", f.requests[1]);
    expect_signed_by(f.requests[1], "ASIALONG", "token-long");
    expect_signed_by(f.requests[2], "ASIALONG", "token-long");
    got = role_fetches(&r);
    cr_expect_str_eq(got, "ASIASHORT\nASIALONG\n", "one renewal");
    free(got);
    store_close(s);
    fake_stop(&f);
    fake_free(&f);
    role_stop(&r);
}

/* The environment's temporary credentials cannot be renewed: ExpiredToken
 * is a refusal at once (not retried), saying how to go on. */
Test(store_wire, expired_environment_credentials_say_how_to_go_on)
{
    setenv("AWS_ACCESS_KEY_ID", "ASIAENV", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "env-secret-never-printed", 1);
    setenv("AWS_SESSION_TOKEN", "token-env", 1);
    fake f = {.answers = {EXPIRED, OK_EMPTY}};
    fake_start(&f);
    store_opts o = {.retry_base_s = 0.01, .retry_max_s = 0.05};
    store_t *s = open_fake(&f, "s3://bkt", &o);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "k", "x", 1, 0, &err), STORE_EAUTH);
    cr_expect(strstr(err.msg, "400 ExpiredToken: The provided token has expired. (the temporary "
                              "credentials from the environment (AWS_ACCESS_KEY_ID, "
                              "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) have expired: restart "
                              "with fresh ones, or, on EC2, unset"),
              "%s", err.msg);
    cr_expect_null(strstr(err.msg, "secret-never"), "%s", err.msg);
    usleep(200 * 1000);
    cr_assert_eq(f.n, 1, "not retried");
    store_close(s);
    fake_stop_unused(&f);
    fake_free(&f);
}

static void expect_open_refused(const char *want1, const char *want2)
{
    store_opts o = {.endpoint = "http://127.0.0.1:9"};
    store_t *s = NULL;
    sp_err err = {0};
    cr_assert_eq(store_open(&s, "s3://bkt", &o, &err), STORE_EUSAGE, "%s", err.msg);
    cr_expect_eq(err.code, SP_EXIT_USAGE);
    cr_expect(strstr(err.msg, want1), "no '%s' in: %s", want1, err.msg);
    cr_expect(!want2 || strstr(err.msg, want2), "no '%s' in: %s", want2, err.msg);
    cr_expect_null(strstr(err.msg, "secret-never"), "%s", err.msg);
}

/* Without the environment's credentials and without a role's, the store is
 * not opened, and the message says what was asked and what answered. */
Test(store_wire, no_credentials_from_anywhere_are_refused_by_name)
{
    role r;
    role_start(&r, "ASIAX", "token-x", 21600);
    /* half the environment's: a mistake, said at once */
    setenv("AWS_ACCESS_KEY_ID", "AKID", 1);
    expect_open_refused("AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not", NULL);
    unsetenv("AWS_ACCESS_KEY_ID");
    /* the service turned off */
    setenv("AWS_EC2_METADATA_DISABLED", "true", 1);
    expect_open_refused("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                        "AWS_EC2_METADATA_DISABLED=true");
    unsetenv("AWS_EC2_METADATA_DISABLED");
    /* the service's answers: no role, not JSON, no Token, a failed Code */
    cr_assert_eq(tu_write_file(r.creds, "{\"status\": 404}"), 0);
    expect_open_refused("no EC2 instance role's could be had from the metadata service at "
                        "http://127.0.0.1:",
                        "/latest/meta-data/iam/security-credentials/: HTTP 404");
    cr_assert_eq(tu_write_file(r.creds, "{\"role\": \"rr\", \"raw\": \"<html>busy</html>\"}"), 0);
    expect_open_refused("security-credentials/rr: not JSON", NULL);
    cr_assert_eq(tu_write_file(r.creds, "{\"role\": \"rr\", \"raw\": \"{\\\"Code\\\": "
                                        "\\\"Success\\\", \\\"AccessKeyId\\\": \\\"A\\\", "
                                        "\\\"SecretAccessKey\\\": \\\"secret-never\\\", "
                                        "\\\"Expiration\\\": \\\"2030-01-01T00:00:00Z\\\"}\"}"),
                 0);
    expect_open_refused("security-credentials/rr: no Token", NULL);
    cr_assert_eq(tu_write_file(r.creds, "{\"role\": \"rr\", \"raw\": \"{\\\"Code\\\": "
                                        "\\\"AssumeRoleUnauthorizedAccess\\\"}\"}"),
                 0);
    expect_open_refused("Code is 'AssumeRoleUnauthorizedAccess', not Success", NULL);
    /* nothing listening there */
    role_stop(&r);
    expect_open_refused("the metadata service at http://127.0.0.1:", "Couldn't connect");
}

/* A container's role (EKS Pod Identity): the endpoint of
 * AWS_CONTAINER_CREDENTIALS_FULL_URI with the token of
 * AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE, read again at each renewal (the
 * platform rotates it); the container's endpoint wins over the instance's.
 * An endpoint in clear elsewhere than this host is refused, and a token the
 * endpoint refuses is named. */
Test(store_wire, a_containers_credentials_follow_its_rotating_token)
{
    role r;
    role_start(&r, "unused", "unused", 21600);
    char *tokfile = sp_strf("%s/pod-token", r.dir);
    cr_assert_eq(tu_write_file(r.creds, "{\"auth\": \"pod-token-A\", \"AccessKeyId\": "
                                        "\"ASIAPOD1\", \"SecretAccessKey\": \"s1\", "
                                        "\"Token\": \"session-1\"}"),
                 0);
    cr_assert_eq(tu_write_file(tokfile, "pod-token-A\n"), 0);
    char *full = sp_strf("%s/v1/credentials", r.url);
    setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", full, 1);
    setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", tokfile, 1);
    fake f = {.answers = {OK_EMPTY, EXPIRED, OK_EMPTY}};
    fake_start(&f);
    store_opts o = {.retry_base_s = 0.01, .retry_max_s = 0.05};
    store_t *s = open_fake(&f, "s3://bkt", &o);
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "a", "x", 1, 0, &err), 0, "%s", err.msg);
    /* the platform rotates the token and the role's credentials */
    cr_assert_eq(tu_write_file(r.creds, "{\"auth\": \"pod-token-B\", \"AccessKeyId\": "
                                        "\"ASIAPOD2\", \"SecretAccessKey\": \"s2\", "
                                        "\"Token\": \"session-2\"}"),
                 0);
    cr_assert_eq(tu_write_file(tokfile, "pod-token-B\n"), 0);
    cr_assert_eq(store_put_bytes(s, "b", "x", 1, 0, &err), 0, "%s", err.msg);
    cr_assert_eq(f.n, 3);
    expect_signed_by(f.requests[0], "ASIAPOD1", "session-1");
    expect_signed_by(f.requests[1], "ASIAPOD1", "session-1");
    expect_signed_by(f.requests[2], "ASIAPOD2", "session-2");
    char *got = role_fetches(&r);
    cr_expect_str_eq(got, "ASIAPOD1\nASIAPOD2\n", "never the instance's");
    free(got);
    store_close(s);
    fake_stop(&f);
    fake_free(&f);
    /* a token the endpoint does not take */
    cr_assert_eq(tu_write_file(tokfile, "stale-token\n"), 0);
    expect_open_refused("the container's credentials endpoint gave none: GET http://127.0.0.1:",
                        "/v1/credentials: HTTP 401");
    /* no token file there */
    char *gone = sp_strf("%s/no-such-token", r.dir);
    setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", gone, 1);
    expect_open_refused("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "no-such-token: No such file");
    /* credentials in clear from another host */
    setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://192.0.2.7/creds", 1);
    expect_open_refused("AWS_CONTAINER_CREDENTIALS_FULL_URI http://192.0.2.7/creds: credentials "
                        "are fetched only over https",
                        NULL);
    unsetenv("AWS_CONTAINER_CREDENTIALS_FULL_URI");
    unsetenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE");
    role_stop(&r);
    free(tokfile), free(full), free(gone);
}

/* STS's answer to AssumeRoleWithWebIdentity (static storage per slot). */
static const char *sts_answer(int slot, const char *id, const char *token)
{
    static char buf[4][1024];
    char body[768];
    int n = snprintf(body, sizeof body,
                     "<AssumeRoleWithWebIdentityResponse><AssumeRoleWithWebIdentityResult>"
                     "<Credentials><AccessKeyId>%s</AccessKeyId><SecretAccessKey>sts-secret-never"
                     "</SecretAccessKey><SessionToken>%s</SessionToken><Expiration>"
                     "2099-01-01T00:00:00Z</Expiration></Credentials>"
                     "</AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>",
                     id, token);
    snprintf(buf[slot], sizeof buf[slot],
             "HTTP/1.1 200 OK\r\nContent-Type: text/xml\r\nContent-Length: %d\r\n"
             "Connection: close\r\n\r\n%s",
             n, body);
    return buf[slot];
}

/* EKS IAM roles for service accounts: the token of
 * AWS_WEB_IDENTITY_TOKEN_FILE exchanged with STS (AWS_ENDPOINT_URL_STS) for
 * the credentials of AWS_ROLE_ARN, in an unsigned AssumeRoleWithWebIdentity
 * request; when the store says they expired, the token file (rotated by
 * then) is read again and exchanged again. STS's refusal is named by its
 * Code, and half the setup is named too. */
Test(store_wire, a_web_identitys_credentials_come_from_sts_and_are_renewed)
{
    char *dir = tu_tempdir("wif"), *tokfile = sp_strf("%s/token", dir);
    cr_assert_eq(tu_write_file(tokfile, "jwt-one\n"), 0);
    const char *refused = error_answer(3, "400 Bad Request", "InvalidIdentityToken",
                                       "No OpenIDConnect provider found");
    /* the refusal twice: an open asks twice */
    fake sts = {.answers = {sts_answer(0, "ASIASTS1", "sts-token-1"),
                            sts_answer(1, "ASIASTS2", "sts-token-2"), refused, refused}};
    fake_start(&sts);
    char *sts_url = sp_strf("http://127.0.0.1:%d/", sts.port);
    unsetenv("AWS_ACCESS_KEY_ID");
    unsetenv("AWS_SECRET_ACCESS_KEY");
    unsetenv("AWS_SESSION_TOKEN");
    setenv("AWS_EC2_METADATA_DISABLED", "true", 1);
    setenv("AWS_WEB_IDENTITY_TOKEN_FILE", tokfile, 1);
    setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/spotune-train", 1);
    setenv("AWS_ROLE_SESSION_NAME", "run-7", 1);
    setenv("AWS_ENDPOINT_URL_STS", sts_url, 1);
    fake f = {.answers = {EXPIRED, OK_EMPTY}};
    fake_start(&f);
    store_opts o = {.retry_base_s = 0.01, .retry_max_s = 0.05};
    store_t *s = open_fake(&f, "s3://bkt", &o);
    cr_assert_eq(tu_write_file(tokfile, "jwt-two\n"), 0); /* the platform rotates it */
    sp_err err = {0};
    cr_assert_eq(store_put_bytes(s, "k", "x", 1, 0, &err), 0, "%s", err.msg);
    store_close(s);
    fake_stop(&f);
    cr_assert_eq(sts.n, 2);
    expect_signed_by(f.requests[0], "ASIASTS1", "sts-token-1");
    expect_signed_by(f.requests[1], "ASIASTS2", "sts-token-2");
    for (int i = 0; i < 2; i++) {
        const char *r = sts.requests[i];
        cr_expect(!strncmp(r, "POST / HTTP/1.1\r\n", 17), "%s", r);
        cr_expect(strstr(r, "Action=AssumeRoleWithWebIdentity&Version=2011-06-15&RoleArn="
                            "arn%3Aaws%3Aiam%3A%3A123456789012%3Arole%2Fspotune-train&"
                            "RoleSessionName=run-7&WebIdentityToken=jwt-"),
                  "%s", r);
        cr_expect(strstr(r, i == 0 ? "WebIdentityToken=jwt-one" : "WebIdentityToken=jwt-two"),
                  "%s", r);
        cr_expect_null(strcasestr(r, "Authorization:"), "STS's request is not signed:\n%s", r);
    }
    /* STS refuses the token */
    expect_open_refused("STS did not give the web identity's role any: POST http://127.0.0.1:",
                        ": HTTP 400 InvalidIdentityToken: No OpenIDConnect provider found");
    fake_stop(&sts);
    fake_free(&sts);
    fake_free(&f);
    /* half the setup */
    unsetenv("AWS_WEB_IDENTITY_TOKEN_FILE");
    expect_open_refused("AWS_ROLE_ARN is set but AWS_WEB_IDENTITY_TOKEN_FILE is not", NULL);
    tu_rmtree(dir);
    free(dir), free(tokfile), free(sts_url);
}

/* A metadata service that takes the connection but never answers the
 * token request (a container on EC2 behind the default hop limit of 1):
 * refused within the 3 s per request (twice), with the fix named. */
Test(store_wire, an_unanswered_metadata_token_request_names_the_hop_limit)
{
    fake f = {.answers = {NULL}}; /* listens, never accepts */
    fake_start(&f);
    char *url = sp_strf("http://127.0.0.1:%d", f.port);
    unsetenv("AWS_ACCESS_KEY_ID");
    unsetenv("AWS_SECRET_ACCESS_KEY");
    unsetenv("AWS_EC2_METADATA_DISABLED"); /* scripts/test.sh sets it */
    setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", url, 1);
    double t0 = sp_now();
    expect_open_refused("/latest/api/token: Timeout was reached",
                        "metadata response hop limit must be 2");
    cr_expect_lt(sp_now() - t0, 10.0);
    fake_stop(&f);
    free(url);
}
