/* trainer/cli.h — the command line: subcommands, their options and help,
 * and the mapping of errors to exit codes (0 done, 2 usage or config, 3 bad
 * model/data/checkpoint input, 75 preempted after a checkpoint, 1 other). */
#ifndef SPOTUNE_CLI_H
#define SPOTUNE_CLI_H

int cli_main(int argc, char **argv);

#endif
