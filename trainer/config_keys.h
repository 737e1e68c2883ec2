/* trainer/config_keys.h — the config schema shared by config.c (loading,
 * validation, writing) and config_keys.c (the table of every key: its type,
 * default, range, whether it changes the math, and its documentation). Not
 * for other modules: they use config.h. */
#ifndef SPOTUNE_CONFIG_KEYS_H
#define SPOTUNE_CONFIG_KEYS_H

#include <stddef.h>

#include "config.h"

typedef enum { K_INT, K_FLOAT, K_BOOL, K_STRING, K_ENUM, K_TARGETS } key_type;

typedef struct key_def {
    const char *name; /* section.key */
    key_type type;
    size_t offset;
    const char *def;          /* default, as YAML text (NULL: required or empty) */
    double min, max;          /* numeric range (inclusive) */
    const char *const *enums; /* K_ENUM choices, NULL-terminated */
    int math;                 /* 1: changing it changes the math (refused on resume);
                                 MATH_SINCE: the same, for a key added after checkpoints
                                 existed: hashed only when set away from its default, so the
                                 checkpoints of earlier versions (which ran at the default)
                                 keep their hash and still resume; MATH_CONTENT: a path
                                 whose file is recognised by its contents, which must
                                 match on resume while the path may change */
    const char *doc;
} key_def;

/* A key added after checkpoints existed (key_def.math) */
#define MATH_SINCE 2
/* A path recognised by its file's contents (key_def.math): model.path (the
 * base model's identity; not hashed) and data.train (the data identity;
 * hashed as a path, as checkpoints of earlier versions were, the identity
 * deciding a resume at another path: trainer/ckpt_resume.c) */
#define MATH_CONTENT 3
/* key_def.max of a number without an upper bound */
#define BIG 9.0e15

extern const key_def config_keys[];
extern const size_t config_nkeys;

#endif


