/* memhold: holds anonymous memory inside a dsec sandbox, for the sleep benchmark (dsec-bench sleep) and the sleep
 * integration tests. Built static (dsec-memhold), so it runs in any image.
 *
 *   memhold MIB DIR
 *
 * Maps MIB MiB of private anonymous memory, fills every page with a pseudo-random stream (it does not compress,
 * and a page that came back wrong changes the sum), and writes into DIR:
 *   pid    its pid
 *   sum    the checksum of the memory, in hex, once it is all written ("ready" follows)
 *   ready  "<MIB> <milliseconds it took>"
 *   count  a counter it raises every 50 ms for as long as it runs (it stands still while the sandbox sleeps)
 * On SIGUSR1 it reads all of the memory again and writes every word back as it was (faulting back whatever went
 * to swap, and leaving every page dirty, as a program at work would: the next sleep has to write it all out again)
 * and writes
 *   check  "ok <sum> <milliseconds>" or "bad <sum> <milliseconds>"
 * Files are written to a temporary name and renamed, so a reader never sees half a file. Exits 2 on bad usage, 3
 * when it cannot map the memory.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t check_requested;

static void on_usr1(int sig) {
  (void)sig;
  check_requested = 1;
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void put(const char *dir, const char *name, const char *text) {
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;
  size_t len = strlen(text);
  if (write(fd, text, len) != (ssize_t)len) {
    close(fd);
    return;
  }
  close(fd);
  rename(tmp, path);
}

/* The checksum: every 64-bit word mixed in by position, so a page that came back elsewhere or zeroed is caught. */
static uint64_t checksum(const uint64_t *words, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ (words[i] + i)) * 1099511628211ULL;
  return h;
}

/* The same, writing every word back (volatile: the compiler may not drop the store). */
static uint64_t checksum_and_dirty(volatile uint64_t *words, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; ++i) {
    uint64_t w = words[i];
    h = (h ^ (w + i)) * 1099511628211ULL;
    words[i] = w;
  }
  return h;
}

int main(int argc, char **argv) {
  if (argc != 3 || atoi(argv[1]) <= 0) {
    fprintf(stderr, "usage: memhold MIB DIR\n");
    return 2;
  }
  const size_t mib = (size_t)atoi(argv[1]);
  const char *dir = argv[2];
  const size_t bytes = mib << 20;
  const size_t n = bytes / sizeof(uint64_t);
  char text[256];

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_usr1;
  sigaction(SIGUSR1, &sa, NULL);

  snprintf(text, sizeof text, "%d\n", (int)getpid());
  put(dir, "pid", text);

  double started = now_ms();
  uint64_t *words = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (words == MAP_FAILED) {
    fprintf(stderr, "memhold: mmap %zu MiB: %s\n", mib, strerror(errno));
    return 3;
  }
  uint64_t x = 0x9E3779B97F4A7C15ULL ^ (uint64_t)mib;
  for (size_t i = 0; i < n; ++i) { /* xorshift64 */
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    words[i] = x;
  }
  const uint64_t sum = checksum(words, n);
  snprintf(text, sizeof text, "%016llx\n", (unsigned long long)sum);
  put(dir, "sum", text);
  snprintf(text, sizeof text, "%zu %.1f\n", mib, now_ms() - started);
  put(dir, "ready", text);

  unsigned long long count = 0;
  for (;;) {
    if (check_requested) {
      check_requested = 0;
      double t0 = now_ms();
      uint64_t again = checksum_and_dirty(words, n);
      snprintf(text, sizeof text, "%s %016llx %.1f\n", again == sum ? "ok" : "bad", (unsigned long long)again,
               now_ms() - t0);
      put(dir, "check", text);
    }
    snprintf(text, sizeof text, "%llu\n", ++count);
    put(dir, "count", text);
    struct timespec tick = {0, 50 * 1000 * 1000};
    nanosleep(&tick, NULL); /* a SIGUSR1 cuts it short */
  }
}
