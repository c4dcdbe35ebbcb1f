/* A static probe uploaded into dsec sandboxes by the integration tests.
 *
 * Each subcommand tries one thing a sandbox must not be able to do and exits 42 only when it was refused in the
 * expected way (the nsjail trick: a stray success or an unexpected error can never look like a pass). Any other
 * outcome prints what happened and exits with another code.
 *
 *   probe x32            a getpid through the x32 ABI: the seccomp filter kills the process (SIGSYS); exit 43 if not
 *   probe rawsock        AF_INET SOCK_RAW and AF_PACKET sockets: EPERM
 *   probe modules        init_module and finit_module: EPERM
 *   probe userns         unshare(CLONE_NEWUSER) and clone(CLONE_NEWUSER): EPERM
 *   probe mount          mount a tmpfs, umount /proc: EPERM
 *   probe memhog MIB     allocates and touches MIB MiB, 1 MiB at a time, printing progress; exit 0 if it got there
 *   probe forks N        forks children that sleep until N forks succeeded or fork fails; prints the count, kills
 *                        the children; exits 42 when fork failed with EAGAIN before N
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if_ether.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static int expect_eperm(const char *what, long rc) {
  if (rc >= 0) {
    printf("%s: succeeded (rc %ld)\n", what, rc);
    return 0;
  }
  if (errno != EPERM) {
    printf("%s: failed with %s, not EPERM\n", what, strerror(errno));
    return 0;
  }
  printf("%s: EPERM\n", what);
  return 1;
}

static int x32(void) {
  long rc = syscall(0x40000000 | __NR_getpid);
  printf("x32 getpid returned %ld (errno %s): the process should have been killed\n", rc, strerror(errno));
  return 43;
}

static int rawsock(void) {
  int ok = expect_eperm("socket(AF_INET, SOCK_RAW, IPPROTO_ICMP)", socket(AF_INET, SOCK_RAW, IPPROTO_ICMP));
  ok &= expect_eperm("socket(AF_PACKET, SOCK_RAW)", socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)));
  return ok ? 42 : 1;
}

static int modules(void) {
  static char image[64];
  int ok = expect_eperm("init_module", syscall(__NR_init_module, image, sizeof image, ""));
  int fd = open("/probe-module.ko", O_RDONLY | O_CREAT, 0600);
  if (fd < 0) fd = open("/dev/null", O_RDONLY);
  ok &= expect_eperm("finit_module", syscall(__NR_finit_module, fd, "", 0));
  return ok ? 42 : 1;
}

static int userns(void) {
  int ok = expect_eperm("unshare(CLONE_NEWUSER)", unshare(CLONE_NEWUSER));
  long pid = syscall(__NR_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
  if (pid == 0) _exit(0); /* in a new user namespace: must never happen */
  if (pid > 0) waitpid((pid_t)pid, NULL, 0);
  ok &= expect_eperm("clone(CLONE_NEWUSER)", pid);
  return ok ? 42 : 1;
}

static int do_mount(void) {
  mkdir("/probe-mnt", 0755);
  int ok = expect_eperm("mount tmpfs", mount("none", "/probe-mnt", "tmpfs", 0, NULL));
  ok &= expect_eperm("umount /proc", umount2("/proc", MNT_DETACH));
  return ok ? 42 : 1;
}

static int memhog(long mib) {
  for (long i = 0; i < mib; ++i) {
    char *p = malloc(1 << 20);
    if (!p) {
      printf("malloc failed after %ld MiB\n", i);
      return 2;
    }
    memset(p, (int)(i & 0xff) | 1, 1 << 20);
    if (i % 16 == 0) {
      printf("%ld MiB\n", i);
      fflush(stdout);
    }
  }
  printf("allocated %ld MiB\n", mib);
  return 0;
}

static int forks(long n) {
  pid_t *children = calloc((size_t)n, sizeof *children);
  long made = 0;
  int err = 0;
  for (; made < n; ++made) {
    pid_t pid = fork();
    if (pid == 0) {
      pause();
      _exit(0);
    }
    if (pid < 0) {
      err = errno;
      break;
    }
    children[made] = pid;
  }
  /* Give the pids back, so the sandbox can run commands again. */
  for (long i = 0; i < made; ++i) kill(children[i], SIGKILL);
  for (long i = 0; i < made; ++i) waitpid(children[i], NULL, 0);
  if (err) {
    printf("%ld forks, then %s\n", made, strerror(err));
    return err == EAGAIN ? 42 : 1;
  }
  printf("%ld forks, none refused\n", made);
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2) {
    fprintf(stderr, "usage: probe x32|rawsock|modules|userns|mount|memhog MIB|forks N\n");
    return 2;
  }
  const char *cmd = argv[1];
  if (!strcmp(cmd, "x32")) return x32();
  if (!strcmp(cmd, "rawsock")) return rawsock();
  if (!strcmp(cmd, "modules")) return modules();
  if (!strcmp(cmd, "userns")) return userns();
  if (!strcmp(cmd, "mount")) return do_mount();
  if (!strcmp(cmd, "memhog") && argc > 2) return memhog(atol(argv[2]));
  if (!strcmp(cmd, "forks") && argc > 2) return forks(atol(argv[2]));
  fprintf(stderr, "probe: unknown command %s\n", cmd);
  return 2;
}
