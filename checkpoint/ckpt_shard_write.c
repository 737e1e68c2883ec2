/* Sharded checkpoint state (ckpt.h, "Sharded state"), the writing side: a
 * rank's shard file (contiguous float32 datasets), hashed whole and in
 * blocks for the ranged readers of ckpt_shard.c. */
#define _GNU_SOURCE
#include "ckpt.h"
#include "ckpt_internal.h"

#include <errno.h>
#include <hdf5.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

const char *const ckpt_shard_groups[CKPT_SHARD_GROUPS] = {"params", "adam_m", "adam_v"};

void ckpt_shard_free(ckpt_shard *sh)
{
    for (int g = 0; g < CKPT_SHARD_GROUPS; g++)
        free(sh->data[g]);
    memset(sh, 0, sizeof *sh);
}

void ckpt_shard_name(char *buf, size_t n, int rank, int count)
{
    snprintf(buf, n, "shard-%05d-of-%05d.h5", rank, count);
}

char *ckpt_tmp_dir(const char *root, int64_t step, int pid)
{
    char name[64];
    ckpt_dir_name(name, sizeof name, step);
    return sp_strf("%s/.tmp-%s-%d", root, name, pid);
}

/* ---- writing ---------------------------------------------------------------------- */

static int write_i64_attr(hid_t f, const char *name, int64_t v)
{
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t at = H5Acreate2(f, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
    int rc = at < 0 || H5Awrite(at, H5T_NATIVE_INT64, &v) < 0 ? -1 : 0;
    if (at >= 0)
        H5Aclose(at);
    H5Sclose(sp);
    return rc;
}

/* A contiguous dataset of n float32 LE values; *offset: where they start in
 * the file (0 when n is 0: nothing is stored). */
static int write_group(hid_t f, const char *name, const float *v, uint64_t n, uint64_t *offset)
{
    hsize_t dims = (hsize_t)n;
    hid_t sp = H5Screate_simple(1, &dims, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    hid_t ds = dcpl < 0 || H5Pset_layout(dcpl, H5D_CONTIGUOUS) < 0
                   ? -1
                   : H5Dcreate2(f, name, H5T_IEEE_F32LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    int rc = ds < 0 || (n && H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) < 0)
                 ? -1
                 : 0;
    haddr_t at = rc || !n ? HADDR_UNDEF : H5Dget_offset(ds);
    if (!rc && n && at == HADDR_UNDEF)
        rc = -1;
    *offset = at == HADDR_UNDEF ? 0 : (uint64_t)at;
    if (dcpl >= 0)
        H5Pclose(dcpl);
    if (ds >= 0 && H5Dclose(ds) < 0)
        rc = -1;
    H5Sclose(sp);
    return rc;
}

static void hex32(const unsigned char md[32], char hex[65])
{
    for (int i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", md[i]);
}

uint64_t ckpt_shard_min_block = (uint64_t)16 << 20;

/* The block size for a file of size bytes: a multiple of
 * ckpt_shard_min_block, at most CKPT_SHARD_MAX_BLOCKS blocks. */
static uint64_t block_bytes_for(uint64_t size)
{
    uint64_t min = ckpt_shard_min_block ? ckpt_shard_min_block : 1;
    uint64_t per = (size + CKPT_SHARD_MAX_BLOCKS - 1) / CKPT_SHARD_MAX_BLOCKS;
    per = (per + min - 1) / min * min;
    return per > min ? per : min;
}

/* The file's size, SHA-256 and per-block SHA-256 into info, in one pass. */
static int hash_blocks(const char *path, ckpt_shard_info *info, sp_err *err)
{
    struct stat st;
    FILE *f = fopen(path, "rb");
    if (!f || fstat(fileno(f), &st) != 0) {
        int e = errno;
        if (f)
            fclose(f);
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot open for its checksum: %s", path,
                       strerror(e));
    }
    info->block_bytes = block_bytes_for((uint64_t)st.st_size);
    EVP_MD_CTX *all = EVP_MD_CTX_new(), *blk = EVP_MD_CTX_new();
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned len = 0;
    uint64_t total = 0, in_block = 0;
    size_t got;
    int ok = all && blk && EVP_DigestInit_ex(all, EVP_sha256(), NULL) == 1 &&
             EVP_DigestInit_ex(blk, EVP_sha256(), NULL) == 1;
    info->nblocks = 0;
    unsigned char *b = malloc(1 << 16);
    ok = ok && b;
    while (ok && (got = fread(b, 1, 1 << 16, f)) > 0) {
        ok = EVP_DigestUpdate(all, b, got) == 1;
        for (size_t k = 0; ok && k < got;) {
            size_t take = got - k;
            if (take > info->block_bytes - in_block)
                take = (size_t)(info->block_bytes - in_block);
            ok = EVP_DigestUpdate(blk, b + k, take) == 1;
            k += take;
            in_block += take;
            if (ok && in_block == info->block_bytes) {
                ok = info->nblocks < CKPT_SHARD_MAX_BLOCKS &&
                     EVP_DigestFinal_ex(blk, info->block_sha256[info->nblocks++], &len) == 1 &&
                     EVP_DigestInit_ex(blk, EVP_sha256(), NULL) == 1;
                in_block = 0;
            }
        }
        total += got;
    }
    if (ok && in_block)
        ok = info->nblocks < CKPT_SHARD_MAX_BLOCKS &&
             EVP_DigestFinal_ex(blk, info->block_sha256[info->nblocks++], &len) == 1;
    ok = ok && !ferror(f) && total == (uint64_t)st.st_size &&
         EVP_DigestFinal_ex(all, md, &len) == 1 && len == 32;
    fclose(f);
    free(b);
    EVP_MD_CTX_free(all);
    EVP_MD_CTX_free(blk);
    if (!ok)
        return sp_fail(err, SP_EXIT_OTHER, "%s: cannot read for its checksum", path);
    hex32(md, info->sha256);
    info->size = total;
    return 0;
}

int ckpt_shard_write(const char *dir, const ckpt_shard *sh, ckpt_shard_info *info, sp_err *err)
{
    memset(info, 0, sizeof *info);
    ckpt_shard_name(info->name, sizeof info->name, sh->rank, sh->count);
    char *path = sp_strf("%s/%s", dir, info->name);
    if (!path)
        return sp_fail(err, SP_EXIT_OTHER, "out of memory");
    int fd, errnum = 0;
    hid_t f = (hid_t)ckpt_hdf5_create(path, &fd);
    int bad = f < 0;
    uint64_t n = sh->hi - sh->lo;
    errno = 0;
    if (!bad)
        bad = write_i64_attr(f, "step", sh->step) || write_i64_attr(f, "rank", sh->rank) ||
              write_i64_attr(f, "count", sh->count) ||
              write_i64_attr(f, "lo", (int64_t)sh->lo) || write_i64_attr(f, "hi", (int64_t)sh->hi);
    for (int g = 0; g < CKPT_SHARD_GROUPS && !bad; g++)
        bad = write_group(f, ckpt_shard_groups[g], sh->data[g], n, &info->data_offset[g]);
    errnum = errno;
    int rc = 0;
    if (f < 0 || ckpt_hdf5_close(f, fd, bad) != 0 || ckpt_fsync_path(path, 0) != 0)
        rc = sp_fail(err, SP_EXIT_OTHER, "%s: cannot write the shard%s%s", path,
                     errnum ? ": " : "", errnum ? strerror(errnum) : "");
    else
        rc = hash_blocks(path, info, err);
    free(path);
    return rc;
}

