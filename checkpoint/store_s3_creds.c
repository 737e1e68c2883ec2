/* checkpoint/store_s3_creds.c — the s3:// backend's credentials.
 *
 * From the environment when AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY is
 * set (both must be; AWS_SESSION_TOKEN with them): read once and never
 * renewed. Otherwise a role's, from the first source that is set up, as the
 * AWS SDKs look for them:
 *  - a web identity (EKS IAM roles for service accounts):
 *    AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN, exchanged with STS
 *    (AWS_ENDPOINT_URL_STS, else the AWS_REGION's);
 *  - the container's endpoint (ECS task role, EKS Pod Identity):
 *    AWS_CONTAINER_CREDENTIALS_FULL_URI or _RELATIVE_URI, with the token of
 *    AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE or _TOKEN;
 *  - the EC2 instance's metadata service, IMDSv2 (a session token, the
 *    role's name, its credentials as JSON); AWS_EC2_METADATA_DISABLED=true
 *    turns it off and AWS_EC2_METADATA_SERVICE_ENDPOINT moves it.
 * A role's are fetched at open and again when less than S3_CREDS_REFRESH_S
 * of their life is left (AWS publishes the next ones at least that long
 * before the old ones expire) or when the store answered ExpiredToken: a
 * run on a spot instance with a role keeps pushing checkpoints for days
 * though each set of credentials lives a few hours. Token files are read
 * again at each renewal (the platforms rotate them).
 *
 * One request at a time asks the source (local services: 1 s to connect,
 * 3 s a request; STS: 5 and 15), outside the credentials' mutex: while the
 * current credentials hold, the other requests go on with them; once they
 * have expired (or the store refused them), the others wait for the
 * renewal. Secrets are wiped when replaced or closed (the
 * body they came in too) and never appear in messages. */
#define _GNU_SOURCE
#include "checkpoint/store_s3.h"

#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define IMDS_DEFAULT "http://169.254.169.254"
#define IMDS_ROLE_PATH "/latest/meta-data/iam/security-credentials/"

/* Writes why (n bytes) and returns -1. */
static int say(char *why, size_t n, const char *fmt, ...) SP_PRINTF(3, 4);

static int say(char *why, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, n, fmt, ap);
    va_end(ap);
    return -1;
}

static void wipe(char **p)
{
    if (*p) {
        explicit_bzero(*p, strlen(*p));
        free(*p);
        *p = NULL;
    }
}

/* ---- the metadata service ----------------------------------------------------- */

static size_t on_body(char *data, size_t size, size_t n, void *arg)
{
    membuf *b = arg;
    if (b->n + size * n > 64 * 1024) /* credentials are a few KiB */
        return 0;
    return membuf_append(b, data, size * n) == 0 ? size * n : 0;
}

/* One request to a credentials service: 0 with the body (NUL-terminated)
 * in *body, or -1 with why (an HTTP error's body kept, NUL-terminated).
 * header: one extra header line or NULL; form: a POST's body (method
 * "POST"); remote: the service is not on this machine or a link-local
 * address (STS), so it goes through the proxies the environment names and
 * has longer to answer. */
static int cred_call(const char *method, const char *url, const char *header, const char *form,
                     int remote, membuf *body, char *why, size_t n)
{
    CURL *h = curl_easy_init();
    struct curl_slist *hdrs = header ? curl_slist_append(NULL, header) : NULL;
    char errbuf[CURL_ERROR_SIZE] = "";
    long status = 0;
    body->n = 0;
    if (!h || (header && !hdrs)) {
        snprintf(why, n, "out of memory");
        curl_slist_free_all(hdrs);
        curl_easy_cleanup(h);
        return -1;
    }
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    if (!remote) /* a link-local address, never through a proxy */
        curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, remote ? 5000L : 1000L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, remote ? 15000L : 3000L);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, body);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdrs);
    if (!strcmp(method, "PUT")) {
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, "PUT");
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, "");
    } else if (form) {
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, form);
    }
    CURLcode cc = curl_easy_perform(h);
    if (cc == CURLE_OK)
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    curl_slist_free_all(hdrs);
    curl_easy_cleanup(h);
    if (cc != CURLE_OK)
        return say(why, n, "%s %s: %s%s%s", method, url, curl_easy_strerror(cc),
                   *errbuf ? ": " : "", errbuf);
    if (membuf_append(body, "", 1))
        return say(why, n, "out of memory");
    if (status != 200)
        return say(why, n, "%s %s: HTTP %ld", method, url, status);
    return 0;
}

/* "2026-12-02T20:15:00Z" as seconds since the epoch, or -1. */
static double parse_expiration(const char *s)
{
    struct tm tm;
    int y, mo, d, hh, mm, ss;
    char z = 0;
    memset(&tm, 0, sizeof tm);
    if (sscanf(s, "%4d-%2d-%2dT%2d:%2d:%2d%c", &y, &mo, &d, &hh, &mm, &ss, &z) != 7 || z != 'Z')
        return -1;
    tm.tm_year = y - 1900;
    tm.tm_mon = mo - 1;
    tm.tm_mday = d;
    tm.tm_hour = hh;
    tm.tm_min = mm;
    tm.tm_sec = ss;
    time_t t = timegm(&tm);
    return t == (time_t)-1 ? -1 : (double)t;
}

static const char *json_text(json_t *o, const char *key)
{
    const char *v = json_string_value(json_object_get(o, key));
    return v && *v ? v : NULL;
}

/* Credentials a service gave, until they replace the store's (install). */
typedef struct fresh_creds {
    char *access_key, *secret_key, *token_hdr;
    double expires;
    char *role; /* an instance role's name, as the service gave it */
} fresh_creds;

static void fresh_free(fresh_creds *f)
{
    wipe(&f->access_key), wipe(&f->secret_key), wipe(&f->token_hdr);
    free(f->role);
    f->role = NULL;
}

/* Credentials a service answered (url), into f. code: the answer's Code,
 * NULL when it has none. */
static int take_fields(fresh_creds *f, const char *url, const char *code, const char *id,
                       const char *secret, const char *token, const char *exp, char *why,
                       size_t n)
{
    double expires = exp ? parse_expiration(exp) : -1;
    if (code && strcmp(code, "Success") != 0)
        return say(why, n, "%s: Code is '%.64s', not Success", url, code);
    if (!id || !secret || !token || expires < 0)
        return say(why, n, "%s: %s", url,
                   !id       ? "no AccessKeyId"
                   : !secret ? "no SecretAccessKey"
                   : !token  ? "no Token"
                   : !exp    ? "no Expiration"
                             : "Expiration is not a UTC time like 2026-12-02T20:15:00Z");
    char *nid = strdup(id), *nsecret = strdup(secret);
    char *ntok = sp_strf("x-amz-security-token: %s", token);
    if (!nid || !nsecret || !ntok) {
        snprintf(why, n, "out of memory");
        wipe(&nid), wipe(&nsecret), wipe(&ntok);
        return -1;
    }
    wipe(&f->access_key), wipe(&f->secret_key), wipe(&f->token_hdr);
    f->access_key = nid;
    f->secret_key = nsecret;
    f->token_hdr = ntok;
    f->expires = expires;
    return 0;
}

/* f's credentials replace c's (under c->mu, or at open); f is emptied. */
static void install(s3_creds *c, fresh_creds *f)
{
    wipe(&c->access_key), wipe(&c->secret_key), wipe(&c->token_hdr);
    c->access_key = f->access_key;
    c->secret_key = f->secret_key;
    c->token_hdr = f->token_hdr;
    f->access_key = f->secret_key = f->token_hdr = NULL;
    c->expires = f->expires;
    if (f->role) {
        free(c->role);
        c->role = f->role;
        f->role = NULL;
    }
    c->stale = 0;
    c->generation++;
}

/* The credentials in a service's JSON answer (from url). */
static int take_json(fresh_creds *f, const char *url, const membuf *body, char *why, size_t n)
{
    json_error_t je;
    json_t *j = json_loads((const char *)body->p, 0, &je);
    if (!j)
        return say(why, n, "GET %s: not JSON (%s at line %d)", url, je.text, je.line);
    char where[600];
    snprintf(where, sizeof where, "GET %s", url);
    int rc = take_fields(f, where, json_text(j, "Code"), json_text(j, "AccessKeyId"),
                         json_text(j, "SecretAccessKey"), json_text(j, "Token"),
                         json_text(j, "Expiration"), why, n);
    json_decref(j); /* its copies are freed, not wiped: jansson has no such option */
    return rc;
}

/* The first line of a token file, malloc'ed; NULL with why. */
static char *read_token(const char *var, const char *path, char *why, size_t n)
{
    FILE *f = fopen(path, "r");
    char line[8192] = "";
    if (!f || !fgets(line, sizeof line, f) || !line[strspn(line, " \r\n")]) {
        snprintf(why, n, "%s %s: %s", var, path, f ? "empty" : strerror(errno));
        if (f)
            fclose(f);
        return NULL;
    }
    fclose(f);
    line[strcspn(line, "\r\n")] = 0;
    char *tok = strdup(line);
    explicit_bzero(line, sizeof line);
    if (!tok)
        snprintf(why, n, "out of memory");
    return tok;
}

/* A web identity's (EKS IAM roles for service accounts): the token of
 * AWS_WEB_IDENTITY_TOKEN_FILE (read again at every renewal: the platform
 * rotates it) exchanged with STS for the credentials of the role
 * AWS_ROLE_ARN (AssumeRoleWithWebIdentity, a request that is not signed). */
static int sts_fetch(const s3_creds *c, fresh_creds *f, membuf *body, char *why, size_t n)
{
    char *tok = read_token("AWS_WEB_IDENTITY_TOKEN_FILE", c->auth_file, why, n);
    if (!tok)
        return -1;
    CURL *e = curl_easy_init();
    char *etok = e ? curl_easy_escape(e, tok, 0) : NULL;
    char *earn = e ? curl_easy_escape(e, c->role, 0) : NULL;
    char *ename = e ? curl_easy_escape(e, c->session, 0) : NULL;
    char *form = etok && earn && ename
                     ? sp_strf("Action=AssumeRoleWithWebIdentity&Version=2011-06-15&RoleArn=%s&"
                               "RoleSessionName=%s&WebIdentityToken=%s",
                               earn, ename, etok)
                     : NULL;
    int rc = -1;
    if (!form)
        snprintf(why, n, "out of memory");
    else if (cred_call("POST", c->service, NULL, form, 1, body, why, n) == 0)
        rc = 0;
    else if (body->n > 1) { /* STS's own reason: <Error><Code>, <Message> */
        char *code = s3_xml_find(body, "Code"), *msg = s3_xml_find(body, "Message");
        size_t k = strlen(why);
        if (code && k < n)
            snprintf(why + k, n - k, " %.64s: %.300s", code, msg ? msg : "");
        free(code), free(msg);
    }
    if (etok) {
        explicit_bzero(etok, strlen(etok));
        curl_free(etok);
    }
    curl_free(earn), curl_free(ename);
    curl_easy_cleanup(e);
    wipe(&form), wipe(&tok);
    if (rc)
        return rc;
    char *id = s3_xml_find(body, "AccessKeyId"), *secret = s3_xml_find(body, "SecretAccessKey");
    char *token = s3_xml_find(body, "SessionToken"), *exp = s3_xml_find(body, "Expiration");
    char where[600];
    snprintf(where, sizeof where, "POST %s (AssumeRoleWithWebIdentity)", c->service);
    rc = take_fields(f, where, NULL, id, secret, token, exp, why, n);
    wipe(&id), wipe(&secret), wipe(&token);
    free(exp);
    return rc;
}

/* An instance role's: the session token, the role's name (the first line),
 * its credentials. */
static int imds_fetch(const s3_creds *c, fresh_creds *f, membuf *body, char *why, size_t n)
{
    char *url = sp_strf("%s/latest/api/token", c->service), *tok_hdr = NULL, *role = NULL;
    int rc = -1;
    if (!url || cred_call("PUT", url, "X-aws-ec2-metadata-token-ttl-seconds: 300", NULL, 0, body,
                          why, n)) {
        size_t k = strlen(why);
        if (strstr(why, "Timeout was reached") && k < n)
            /* the answer to a PUT crosses one network hop by default, so
             * inside a container it never arrives */
            snprintf(why + k, n - k,
                     " (in a container on EC2, the instance's metadata response hop limit must "
                     "be 2: aws ec2 modify-instance-metadata-options "
                     "--http-put-response-hop-limit 2)");
        goto out;
    }
    tok_hdr = sp_strf("X-aws-ec2-metadata-token: %.*s", (int)strcspn((char *)body->p, "\r\n"),
                      (char *)body->p);
    free(url);
    url = sp_strf("%s" IMDS_ROLE_PATH, c->service);
    if (!tok_hdr || !url || cred_call("GET", url, tok_hdr, NULL, 0, body, why, n))
        goto out;
    role = strndup((char *)body->p, strcspn((char *)body->p, "\r\n"));
    if (!role || !*role) {
        snprintf(why, n, "GET %s: no role attached to this instance", url);
        goto out;
    }
    free(url);
    url = sp_strf("%s" IMDS_ROLE_PATH "%s", c->service, role);
    if (!url || cred_call("GET", url, tok_hdr, NULL, 0, body, why, n) ||
        take_json(f, url, body, why, n))
        goto out;
    f->role = role;
    role = NULL;
    rc = 0;
out:
    free(url);
    wipe(&tok_hdr);
    free(role);
    return rc;
}

/* A container's (ECS task role, EKS Pod Identity): one GET of the
 * endpoint, with the authorization token (read from its file each time:
 * the platform rotates it) when there is one. */
static int container_fetch(const s3_creds *c, fresh_creds *f, membuf *body, char *why,
                           size_t n)
{
    char *auth = NULL, *hdr = NULL;
    if (c->auth_file) {
        if (!(auth = read_token("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", c->auth_file, why, n)))
            return -1;
    } else if (s3_env("AWS_CONTAINER_AUTHORIZATION_TOKEN")) {
        auth = strdup(s3_env("AWS_CONTAINER_AUTHORIZATION_TOKEN"));
    }
    if (auth && !(hdr = sp_strf("Authorization: %s", auth))) {
        wipe(&auth);
        return say(why, n, "out of memory");
    }
    wipe(&auth);
    int rc = cred_call("GET", c->service, hdr, NULL, 0, body, why, n) ||
             take_json(f, c->service, body, why, n);
    wipe(&hdr);
    return rc ? -1 : 0;
}

/* Asks c's source for credentials, into f (emptied first). Reads only what
 * is fixed at open (the kind, the service, the token file, the web
 * identity's role and session), so it runs without c->mu. */
static int fetch(const s3_creds *c, fresh_creds *f, char *why, size_t n)
{
    membuf body = {0};
    fresh_free(f);
    int rc = c->kind == S3_CREDS_CONTAINER     ? container_fetch(c, f, &body, why, n)
             : c->kind == S3_CREDS_WEB_IDENTITY ? sts_fetch(c, f, &body, why, n)
                                                : imds_fetch(c, f, &body, why, n);
    if (body.p)
        explicit_bzero(body.p, body.n);
    membuf_free(&body);
    return rc;
}

/* A container endpoint must be https, or http to the host itself or to the
 * platforms' link-local agents (as the AWS SDKs require): credentials are
 * never fetched in clear from elsewhere. */
static int container_url_ok(const char *url)
{
    static const char *const hosts[] = {"http://127.", "http://localhost:", "http://localhost/",
                                        "http://[::1]", "http://169.254.170.2:",
                                        "http://169.254.170.2/", "http://169.254.170.23:",
                                        "http://169.254.170.23/", "http://[fd00:ec2::23]"};
    if (!strncasecmp(url, "https://", 8))
        return 1;
    for (size_t i = 0; i < sizeof hosts / sizeof hosts[0]; i++)
        if (!strncasecmp(url, hosts[i], strlen(hosts[i])))
            return 1;
    return 0;
}

/* Where the renewable credentials come from: a web identity when it is set
 * up, else the container's endpoint when the platform set one, else the
 * instance metadata service. 0, or -1 with why. */
static int pick_service(s3_creds *c, char *why, size_t n)
{
    const char *wif = s3_env("AWS_WEB_IDENTITY_TOKEN_FILE");
    const char *arn = s3_env("AWS_ROLE_ARN");
    if (wif || arn) {
        if (!wif || !arn)
            return say(why, n, "%s is set but %s is not",
                       wif ? "AWS_WEB_IDENTITY_TOKEN_FILE" : "AWS_ROLE_ARN",
                       wif ? "AWS_ROLE_ARN" : "AWS_WEB_IDENTITY_TOKEN_FILE");
        const char *ep = s3_env("AWS_ENDPOINT_URL_STS");
        const char *region = s3_env("AWS_REGION");
        if (!region)
            region = s3_env("AWS_DEFAULT_REGION");
        const char *name = s3_env("AWS_ROLE_SESSION_NAME");
        c->kind = S3_CREDS_WEB_IDENTITY;
        c->service = ep       ? strdup(ep)
                     : region ? sp_strf("https://sts.%s.amazonaws.com/", region)
                              : strdup("https://sts.amazonaws.com/");
        c->auth_file = strdup(wif);
        c->role = strdup(arn);
        c->session = name ? strdup(name) : sp_strf("spotune-%ld", (long)time(NULL));
        if (!c->service || !c->auth_file || !c->role || !c->session)
            return say(why, n, "out of memory");
        snprintf(c->source, sizeof c->source,
                 "the web identity of AWS_WEB_IDENTITY_TOKEN_FILE for the role %.150s (STS at "
                 "%.150s)",
                 c->role, c->service);
        return 0;
    }
    const char *full = s3_env("AWS_CONTAINER_CREDENTIALS_FULL_URI");
    const char *rel = s3_env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI");
    if (rel || full) {
        c->kind = S3_CREDS_CONTAINER;
        c->service = rel ? sp_strf("http://169.254.170.2%s", rel) : strdup(full);
        if (s3_env("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"))
            c->auth_file = strdup(s3_env("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"));
        if (!c->service)
            return say(why, n, "out of memory");
        if (!container_url_ok(c->service))
            return say(why, n,
                       "AWS_CONTAINER_CREDENTIALS_FULL_URI %s: credentials are fetched only over "
                       "https, or over http from this host or the platform's link-local agent "
                       "(169.254.170.2, 169.254.170.23)",
                       c->service);
        snprintf(c->source, sizeof c->source, "the container's credentials endpoint %.300s",
                 c->service);
        return 0;
    }
    const char *off = s3_env("AWS_EC2_METADATA_DISABLED");
    if (off && !strcasecmp(off, "true"))
        return say(why, n, "AWS_EC2_METADATA_DISABLED=true: no instance role is asked");
    const char *ep = s3_env("AWS_EC2_METADATA_SERVICE_ENDPOINT");
    c->kind = S3_CREDS_INSTANCE;
    c->service = strdup(ep ? ep : IMDS_DEFAULT);
    if (!c->service)
        return say(why, n, "out of memory");
    for (size_t k = strlen(c->service); k > 0 && c->service[k - 1] == '/'; k--)
        c->service[k - 1] = 0;
    return 0;
}

/* ---- the API (store_s3.h) ------------------------------------------------------ */

int s3_creds_open(store_t *s, s3_creds *c, sp_err *err)
{
    const char *id = s3_env("AWS_ACCESS_KEY_ID");
    const char *secret = s3_env("AWS_SECRET_ACCESS_KEY");
    const char *token = s3_env("AWS_SESSION_TOKEN");
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->renewed, NULL);
    c->ready = 1;
    if (id || secret) {
        if (!id || !secret)
            return store_fail(s, err, STORE_EUSAGE, NULL,
                              "no credentials: %s is set but %s is not (set both, or neither "
                              "to use the instance or container role's)",
                              id ? "AWS_ACCESS_KEY_ID" : "AWS_SECRET_ACCESS_KEY",
                              id ? "AWS_SECRET_ACCESS_KEY" : "AWS_ACCESS_KEY_ID");
        c->access_key = strdup(id);
        c->secret_key = strdup(secret);
        if (token)
            c->token_hdr = sp_strf("x-amz-security-token: %s", token);
        if (!c->access_key || !c->secret_key || (token && !c->token_hdr))
            return store_fail(s, err, STORE_EFAIL, NULL, "out of memory");
        snprintf(c->source, sizeof c->source, "the environment (AWS_ACCESS_KEY_ID, "
                                              "AWS_SECRET_ACCESS_KEY%s)",
                 token ? ", AWS_SESSION_TOKEN" : "");
        return 0;
    }
    char why[600] = "";
    if (pick_service(c, why, sizeof why))
        return store_fail(s, err, STORE_EUSAGE, NULL,
                          "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (%s)",
                          why);
    int rc = -1;
    fresh_creds f = {0};
    for (int attempt = 0; attempt < 2 && rc; attempt++) /* one retry, as the SDKs' default */
        rc = fetch(c, &f, why, sizeof why);
    if (!rc)
        install(c, &f);
    fresh_free(&f);
    c->last_try = sp_now();
    if (rc && c->kind == S3_CREDS_WEB_IDENTITY)
        return store_fail(s, err, STORE_EUSAGE, NULL,
                          "no credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not "
                          "set, and STS did not give the web identity's role any: %s",
                          why);
    if (rc && c->kind == S3_CREDS_CONTAINER)
        return store_fail(s, err, STORE_EUSAGE, NULL,
                          "no credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not "
                          "set, and the container's credentials endpoint gave none: %s",
                          why);
    if (rc)
        return store_fail(s, err, STORE_EUSAGE, NULL,
                          "no credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not "
                          "set, and no EC2 instance role's could be had from the metadata "
                          "service at %s: %s",
                          c->service, why);
    if (c->kind == S3_CREDS_INSTANCE)
        snprintf(c->source, sizeof c->source,
                 "the EC2 instance role '%.100s' (metadata service %.200s)", c->role, c->service);
    return 0;
}

int s3_creds_use(s3_creds *c, s3_cred_use *u, char *detail, size_t dn)
{
    memset(u, 0, sizeof *u);
    pthread_mutex_lock(&c->mu);
    double now_wall, now;
    int expired, due;
    for (;;) {
        now_wall = (double)time(NULL), now = sp_now();
        expired = c->kind && (c->stale || now_wall >= c->expires);
        due = c->kind && (expired || (now_wall >= c->expires - S3_CREDS_REFRESH_S &&
                                      now - c->last_try >= S3_CREDS_RETRY_S));
        if (!(expired && c->renewing))
            break;
        /* nothing valid until the renewal in flight ends */
        pthread_cond_wait(&c->renewed, &c->mu);
    }
    if (due && !c->renewing) {
        /* one request asks the service, outside the mutex: the others go on
         * with the current credentials while they hold, or wait above */
        char why[600] = "";
        int refused = c->stale;
        fresh_creds f = {0};
        c->last_try = now;
        c->renewing = 1;
        pthread_mutex_unlock(&c->mu);
        int rc = fetch(c, &f, why, sizeof why);
        pthread_mutex_lock(&c->mu);
        if (!rc)
            install(c, &f);
        fresh_free(&f);
        c->renewing = 0;
        pthread_cond_broadcast(&c->renewed);
        if (rc && expired) {
            pthread_mutex_unlock(&c->mu);
            snprintf(detail, dn, "the credentials from %s %s and could not be renewed: %s",
                     c->source, refused ? "were refused as expired" : "have expired", why);
            return 1; /* the service may answer on the next attempt */
        }
    }
    u->access_key = strdup(c->access_key);
    u->secret_key = strdup(c->secret_key);
    u->token_hdr = c->token_hdr ? strdup(c->token_hdr) : NULL;
    u->generation = c->generation;
    pthread_mutex_unlock(&c->mu);
    if (!u->access_key || !u->secret_key || (c->token_hdr && !u->token_hdr)) {
        s3_cred_use_free(u);
        snprintf(detail, dn, "out of memory");
        return STORE_EFAIL;
    }
    return 0;
}

int s3_creds_expired(s3_creds *c, const s3_cred_use *u)
{
    pthread_mutex_lock(&c->mu);
    int renewable = c->kind != S3_CREDS_ENV;
    if (renewable && u->generation == c->generation)
        c->stale = 1; /* ones fetched since by another request are kept */
    pthread_mutex_unlock(&c->mu);
    return renewable;
}

void s3_cred_use_free(s3_cred_use *u)
{
    wipe(&u->access_key);
    wipe(&u->secret_key);
    wipe(&u->token_hdr);
}

void s3_creds_close(s3_creds *c)
{
    wipe(&c->access_key);
    wipe(&c->secret_key);
    wipe(&c->token_hdr);
    free(c->service);
    free(c->auth_file);
    free(c->role);
    free(c->session);
    if (c->ready) {
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->renewed);
    }
    memset(c, 0, sizeof *c);
}

int store_s3_credentials(char *source, size_t n, sp_err *err)
{
    s3_creds c;
    int rc = s3_creds_open(NULL, &c, err);
    if (!rc && c.kind) {
        char when[32] = "?";
        time_t t = (time_t)c.expires;
        struct tm tm;
        if (gmtime_r(&t, &tm))
            strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
        snprintf(source, n, "%s, valid until %s (renewed %.0f minutes before)", c.source, when,
                 S3_CREDS_REFRESH_S / 60.0);
    } else if (!rc) {
        snprintf(source, n, "%s", c.source);
    }
    s3_creds_close(&c);
    return rc;
}
