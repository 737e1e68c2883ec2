/* tests/doctor_report.h — reading spotune doctor's text report in tests
 * (test_doctor.c, test_doctor_blas.c): a check's line and its status. */
#ifndef SPOTUNE_TESTS_DOCTOR_REPORT_H
#define SPOTUNE_TESTS_DOCTOR_REPORT_H

#include <stdio.h>
#include <string.h>

/* The line of check name in a text report ("" when absent; a static copy). */
static inline const char *line_of(const char *out, const char *name)
{
    static char buf[4096];
    buf[0] = 0;
    for (const char *p = out; p && *p;) {
        const char *e = strchr(p, '\n');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        char status[16], nm[128];
        if (sscanf(p, "%15s %127s", status, nm) == 2 && !strcmp(nm, name)) {
            snprintf(buf, sizeof buf, "%.*s", (int)n, p);
            return buf;
        }
        p = e ? e + 1 : NULL;
    }
    return buf;
}

static inline int has_status(const char *out, const char *name, const char *status)
{
    const char *l = line_of(out, name);
    return !strncmp(l, status, strlen(status)) && l[strlen(status)] == ' ';
}

#define EXPECT_STATUS(out, name, st)                                                           \
    cr_expect(has_status(out, name, st), "%s should be %s: '%s'\n%s", name, st,                \
              line_of(out, name), out)

#endif
