/* checkpoint/ckpt_internal.h — shared by the files of the checkpoint
 * directory protocol: ckpt.c (writing), ckpt_read.c (verifying, reading),
 * ckpt_list.c (listing, retention) and ckpt_shard.c (sharded state). */
#ifndef SPOTUNE_CKPT_INTERNAL_H
#define SPOTUNE_CKPT_INTERNAL_H

/* fsync of a file (dir 0) or a directory (dir 1); 0 or -1 with errno. */
int ckpt_fsync_path(const char *path, int dir);

#endif
