/* checkpoint/ckpt_internal.h — shared by ckpt.c (writing, verifying and
 * reading a checkpoint directory) and ckpt_list.c (listing and retention). */
#ifndef SPOTUNE_CKPT_INTERNAL_H
#define SPOTUNE_CKPT_INTERNAL_H

/* fsync of a file (dir 0) or a directory (dir 1); 0 or -1 with errno. */
int ckpt_fsync_path(const char *path, int dir);

#endif
